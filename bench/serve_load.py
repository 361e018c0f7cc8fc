"""Load benchmark of `hyspec serve` (an httpx async client): bounded Poisson load; what `vllm bench serve` reports.

For each concurrency C: requests arrive as a Poisson process of rate --rate (default: infinite = all at once)
and at most C are in flight (a semaphore bounds the load; arrivals wait for a free place). Each request is a
streamed /v1/completions with `ignore_eos` (fixed output length) and `stream_options.include_usage`; the client
records the time of every token-bearing SSE event (`return_token_ids`: also tokens with no text yet). Prompts
are random words, or (--dataset heldout) the shipped held-out text pack as token ids.

  TTFT  time from sending the request to its first token
  TPOT  (latency − TTFT) / (output tokens − 1), per request
  ITL   gaps between token-bearing events (a speculative round may deliver several tokens in one event)
  E2EL  request latency
  throughput  requests/s, output tokens/s and prompt + output tokens/s over the wall time of the level
Each latency as mean, std, median (p50), p90 and p99.

Either point it at a running server (--url) or let it start one per mode (--model, --modes ar,chain, --drafter):
the server is started, warmed up (it compiles at start-up), measured, and stopped with SIGTERM. Several --url
(LABEL=URL) take turns level by level, so a comparison's pairs are measured seconds apart rather than a pass
apart: on a GPU one mode's tok/s moved by up to 1.5x between passes (`bench/results/budget/serve_margin_h100.md`).
Server-side counters (/metrics) are read before and after each level: speculative acceptance (accepted tokens
per draft, mean committed tokens per round) and compilations after start-up (must stay 0).

    python -m hyspec_jax.bench.serve_load --model DIR --modes ar --concurrency 1,4,16 --json out.json

A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact").split()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict:
    """mean, std, median (p50) and percentiles, as `vllm bench serve` reports them."""
    if not xs:
        return {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs), "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9),
            "p99": _pct(xs, 0.99)}


def _client(base: str, api_key: str | None, concurrency: int) -> httpx.AsyncClient:
    """One pooled async client per level (connections kept alive, as `vllm bench serve`'s aiohttp session)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=httpx.Timeout(None))


async def get_text(client: httpx.AsyncClient, path: str) -> str:
    r = await client.get(path)
    return r.text


async def one_request(client: httpx.AsyncClient, payload: dict) -> dict:
    """One streamed completion: the time of every token-bearing SSE event, the usage, the status."""
    t0 = time.perf_counter()
    events: list[float] = []
    usage = None
    error = None
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode(errors="replace")
            return {"status": r.status_code, "error": body[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"].get("message")
                continue
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("choices") and (obj["choices"][0].get("token_ids") or obj["choices"][0].get("text")):
                events.append(time.perf_counter())
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(events)
    ttft = events[0] - t0 if events else None
    return {"status": 200, "error": error, "tokens": n, "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "ttft": ttft, "latency": t_end - t0,
            "tpot": (t_end - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None,
            "itl": [b - a for a, b in zip(events, events[1:])]}


def _prompt(rng: random.Random, words: int, i: int) -> str:
    return f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def heldout_prompts() -> list[list[int]]:
    """The shipped held-out text pack (`bench/data/heldout_prompts.npz`, as `hyspec bench e2e` uses): windows of
    token ids of the embedded model's tokenizer, sent as token-id prompts."""
    import numpy as np

    from hyspec_jax.bench.e2e import DEFAULT_PROMPTS
    with np.load(DEFAULT_PROMPTS) as d:
        return [[int(t) for t in row] for row in d["tokens"]]


def _samples(text: str, name: str):
    """(labels, value) of every sample of metric `name` in a Prometheus text exposition."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name:
            yield dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))


def _metric(text: str, name: str, **labels) -> float:
    return sum(v for lab, v in _samples(text, name) if all(lab.get(k) == x for k, x in labels.items()))


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in _samples(text, name):
        if label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out


async def run_level(client: httpx.AsyncClient, *, concurrency: int, num_requests: int, rate: float,
                    prompt_words: int, max_tokens: int, seed: int, temperature: float,
                    dataset: list[list[int]] | None = None) -> dict:
    rng = random.Random(seed)
    before = await get_text(client, "/metrics")
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def worker(i: int, payload: dict):
        async with sem:
            results.append(await one_request(client, payload))

    tasks = []
    t0 = time.perf_counter()
    for i in range(num_requests):
        prompt = dataset[i % len(dataset)] if dataset else _prompt(rng, prompt_words, i)
        payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": i,
                   "return_token_ids": True}
        tasks.append(asyncio.create_task(worker(i, payload)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    after = await get_text(client, "/metrics")
    ok = [r for r in results if r["status"] == 200 and not r.get("error")]
    d = lambda name, **kw: _metric(after, name, **kw) - _metric(before, name, **kw)  # noqa: E731
    drafts = d("vllm:spec_decode_num_drafts_total")
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "concurrency": concurrency, "rate": None if rate == float("inf") else rate, "requests": num_requests, "ok": len(ok),
        "errors": [r.get("error") or r["status"] for r in results if r not in ok][:5],
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
        "output_tokens": out_tokens, "wall_s": wall,
        "throughput_tok_s": out_tokens / wall, "throughput_req_s": len(ok) / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall,
        "ttft_s": _summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": _summary([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": _summary([x for r in ok for x in r["itl"]]),
        "latency_s": _summary([r["latency"] for r in ok]),
        "server": {
            "engine_decode_steps": d("hyspec:engine_steps_total", kind="decode"),
            "engine_prefill_calls": d("hyspec:engine_steps_total", kind="prefill"),
            # decoding steps that went out before the one in flight was read; the loop's time in prefill calls
            "engine_steps_ahead": d("hyspec:engine_steps_ahead_total"),
            "engine_prefill_seconds": d("hyspec:engine_prefill_seconds_total"),
            # the loop's time dispatching decoding steps and collecting them (a collect near 0: host-bound)
            "engine_dispatch_seconds": d("hyspec:engine_decode_dispatch_seconds_total"),
            "engine_collect_seconds": d("hyspec:engine_decode_collect_seconds_total"),
            "spec_drafts": drafts,
            "spec_acceptance_rate": (d("vllm:spec_decode_num_accepted_tokens_total")
                                     / d("vllm:spec_decode_num_draft_tokens_total")) if drafts else None,
            "spec_tokens_per_round": (1 + d("vllm:spec_decode_num_accepted_tokens_total") / drafts) if drafts else None,
            "compilations_after_startup": d("hyspec:compilations_after_startup_total"),
            # rounds by the nodes verified per request (the width chosen each round; 1: a plain step)
            "spec_rounds_by_width": _rounds_by_width(before, after),
        },
    }


def _rounds_by_width(before: str, after: str) -> dict[str, int]:
    b, a = _by_label(before, "hyspec:spec_rounds_total", "width"), _by_label(after, "hyspec:spec_rounds_total", "width")
    out = {w: int(a[w] - b.get(w, 0.0)) for w in sorted(a, key=int)}
    return {w: n for w, n in out.items() if n}


def start_server(args, mode: str, log: Path) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "hyspec_jax.serve", "--port", "0", "--max-batch", str(args.max_batch),
           "--max-queue", str(max(args.num_requests, 1)), "--max-model-len", str(args.max_model_len),
           "--prefill-chunk", str(args.prefill_chunk), "--spec-mode", mode]
    if args.model:
        cmd += ["--model", args.model]
    if mode != "ar":
        if not args.drafter:
            raise SystemExit(f"serve_load: mode {mode} needs --drafter")
        cmd += ["--drafter", args.drafter]
    with open(log, "wb") as f:
        env = dict(os.environ, **({"HYSPEC_API_KEY": args.api_key} if args.api_key else {}))
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        m = re.search(r"on http://[\d.]+:(\d+)", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise SystemExit(f"serve_load: server exited ({proc.returncode}):\n{log.read_text(errors='replace')}")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"serve_load: server did not start in {args.startup_timeout}s")


def _fmt(x, scale=1.0, nd=1) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def print_table(rows: list[dict], header: bool = True) -> None:
    if header:
        print(f"{'mode':<10} {'conc':>4} {'ok':>4} {'tok/s':>8} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'acc':>5} {'τ':>5}", file=sys.stderr)
    for r in rows:
        s = r["server"]
        print(f"{r['mode']:<10} {r['concurrency']:>4} {r['ok']:>4} {r['throughput_tok_s']:>8.1f} "
              f"{r['throughput_req_s']:>6.2f} {_fmt(r['ttft_s']['p50'], 1e3):>7}ms {_fmt(r['ttft_s']['p99'], 1e3):>7}ms "
              f"{_fmt(r['tpot_s']['p50'], 1e3):>7}ms {_fmt(r['tpot_s']['p99'], 1e3):>7}ms "
              f"{_fmt(r['itl_s']['p50'], 1e3):>6}ms {_fmt(s['spec_acceptance_rate'], 1, 2):>5} "
              f"{_fmt(s['spec_tokens_per_round'], 1, 2):>5}", file=sys.stderr)


def parse_url(value: str) -> tuple[str, str | None]:
    """--url [LABEL=]URL: (url without a trailing slash, label or None)."""
    label, sep, url = value.partition("=")
    if not sep or "://" in label:
        return value.rstrip("/"), None
    return url.rstrip("/"), label or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", metavar="[LABEL=]URL",
                   help="a running server (e.g. http://127.0.0.1:8000); otherwise one is started per mode. Given "
                        "more than once, the servers take turns level by level (the order reversed every other "
                        "level), so each level's results of the servers are seconds apart and a drift of the "
                        "machine falls on all alike; LABEL names a server's rows (default: its spec mode)")
    p.add_argument("--model", help="model directory for started servers (default: hyspec serve's default)")
    p.add_argument("--modes", default="ar", help="comma-separated spec modes to start servers for (default ar)")
    p.add_argument("--drafter", help="drafter directory (speculative modes)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated in-flight bounds (default 1,4,16)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level (default 32)")
    p.add_argument("--waves", type=int, default=0, metavar="K",
                   help="at least K x concurrency requests per level (default 0: --num-requests alone); a level "
                        "of one wave is mostly its ramp: every prompt arrives at once and it ends with the last")
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrival rate, requests/s (default inf)")
    p.add_argument("--dataset", choices=("random", "heldout"), default="random",
                   help="prompts: random words (default) or the shipped held-out text pack as token ids (the "
                        "embedded model's tokenizer)")
    p.add_argument("--prompt-words", type=int, default=24, help="words per synthetic prompt (default 24)")
    p.add_argument("--api-key", default=os.environ.get("HYSPEC_API_KEY"),
                   help="Bearer key of the server (default $HYSPEC_API_KEY; started servers get it too)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos; default 64)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the levels (default 2)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write results as JSON (to PATH or stdout)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    if args.num_requests < 1 or args.waves < 0 or not levels or min(levels) < 1:
        p.error("--num-requests and every --concurrency level must be >= 1, --waves >= 0")

    def level_requests(c: int) -> int:
        return max(args.num_requests, args.waves * c)
    rows: list[dict] = []

    dataset = heldout_prompts() if args.dataset == "heldout" else None

    def measure(servers: list[tuple[str, str | None]]) -> None:
        """Every level on each (url, label) server in turn (the order reversed every other level)."""
        async def go():
            async with contextlib.AsyncExitStack() as stack:
                clients, labels = [], []
                for base, mode in servers:
                    client = await stack.enter_async_context(_client(base, args.api_key, max(levels)))
                    label = mode
                    if label is None:
                        try:
                            label = json.loads(await get_text(client, "/v1/models"))["data"][0].get("spec_mode")
                        except Exception:  # noqa: BLE001 - only a label
                            pass
                    clients.append(client)
                    labels.append(label or "server")
                if len(set(labels)) < len(labels):
                    p.error(f"--url: two servers would both be named {sorted(labels)}: name them, LABEL=URL")
                for client in clients:
                    for i in range(args.warmup):
                        await one_request(client, {"prompt": f"warm-up {i}", "max_tokens": 4, "stream": True,
                                                   "stream_options": {"include_usage": True}})
                for k, c in enumerate(levels):
                    turn = list(zip(clients, labels))
                    for client, label in (turn if k % 2 == 0 else turn[::-1]):
                        row = await run_level(client, concurrency=c, num_requests=level_requests(c), rate=args.rate,
                                              prompt_words=args.prompt_words, max_tokens=args.max_tokens,
                                              seed=args.seed, temperature=args.temperature, dataset=dataset)
                        row["mode"] = label
                        rows.append(row)
                        print_table([row], header=len(rows) == 1)
        asyncio.run(go())

    if args.url:
        measure([parse_url(u) for u in args.url])
    else:
        import tempfile
        for mode in [m for m in args.modes.split(",") if m]:
            log = Path(tempfile.mkdtemp(prefix="serve_load_")) / f"server-{mode}.log"
            proc, port = start_server(args, mode, log)
            try:
                measure([(f"http://127.0.0.1:{port}", mode)])
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    meta = {"bench": "serve_load", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
            "args": {k: (None if v == float("inf") else v) for k, v in vars(args).items() if k != "json"}}
    try:        # the client's machine (the servers' on loopback): device, versions, commit
        from hyspec_jax.bench.report import run_metadata
        run = run_metadata()
        meta.update(device=str(run["device_kind"]), **run)
    except Exception:  # noqa: BLE001
        pass
    if len(rows) > 1:
        print("", file=sys.stderr)
        print_table(rows)
    if args.json:
        text = json.dumps({"meta": meta, "results": rows}, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
