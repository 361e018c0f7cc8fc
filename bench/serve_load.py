"""Load benchmark of `hyspec serve`: bounded Poisson load on loopback; TTFT / TPOT / throughput per concurrency.

For each concurrency C: requests arrive as a Poisson process of rate --rate (default: infinite = all at once)
and at most C are in flight (a semaphore bounds the load; arrivals wait for a free place). Each request is a
streamed /v1/completions with `ignore_eos` (fixed output length) and `stream_options.include_usage`; the client
records the time of every token-bearing SSE event (`return_token_ids`: also tokens with no text yet).

  TTFT  time from sending the request to its first token
  TPOT  (latency − TTFT) / (output tokens − 1), per request
  ITL   gaps between token-bearing events (a speculative round may deliver several tokens in one event)
  throughput  output tokens / wall time of the level (and requests/s)

Either point it at a running server (--url) or let it start one per mode (--model, --modes ar,chain, --drafter):
the server is started, warmed up (it compiles at start-up), measured, and stopped with SIGTERM.
Server-side counters (/metrics) are read before and after each level: speculative acceptance (accepted tokens
per draft, mean committed tokens per round) and compilations after start-up (must stay 0).

    python -m hyspec_jax.bench.serve_load --model DIR --modes ar --concurrency 1,4,16 --json out.json

A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
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
from urllib.parse import urlsplit

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
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": statistics.fmean(xs), "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9), "p99": _pct(xs, 0.99)}


async def _http(host: str, port: int, method: str, path: str, body: bytes | None = None):
    """One request on a fresh connection; returns (status, headers, reader, writer) after the head."""
    reader, writer = await asyncio.open_connection(host, port)
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return status, headers, reader, writer


async def _body(headers: dict, reader: asyncio.StreamReader):
    """Yield body pieces (chunked or fixed length)."""
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    n = int(headers.get("content-length", "0"))
    yield await reader.readexactly(n)


async def get_text(host: str, port: int, path: str) -> str:
    status, headers, reader, writer = await _http(host, port, "GET", path)
    out = b"".join([piece async for piece in _body(headers, reader)])
    writer.close()
    return out.decode()


async def one_request(host: str, port: int, payload: dict) -> dict:
    t0 = time.perf_counter()
    status, headers, reader, writer = await _http(host, port, "POST", "/v1/completions", json.dumps(payload).encode())
    events: list[float] = []
    usage = None
    error = None
    buf = b""
    try:
        if status != 200:
            error = (b"".join([p async for p in _body(headers, reader)])).decode(errors="replace")
            return {"status": status, "error": error[:200]}
        async for piece in _body(headers, reader):
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                data = event[6:]
                if data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"].get("message")
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices") and (obj["choices"][0].get("token_ids") or obj["choices"][0].get("text")):
                    events.append(time.perf_counter())
    finally:
        writer.close()
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(events)
    ttft = events[0] - t0 if events else None
    return {"status": status, "error": error, "tokens": n, "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "ttft": ttft, "latency": t_end - t0,
            "tpot": (t_end - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None,
            "itl": [b - a for a, b in zip(events, events[1:])]}


def _prompt(rng: random.Random, words: int, i: int) -> str:
    return f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


async def run_level(host: str, port: int, *, concurrency: int, num_requests: int, rate: float, prompt_words: int,
                    max_tokens: int, seed: int, temperature: float) -> dict:
    rng = random.Random(seed)
    before = await get_text(host, port, "/metrics")
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def worker(i: int, payload: dict):
        async with sem:
            results.append(await one_request(host, port, payload))

    tasks = []
    t0 = time.perf_counter()
    for i in range(num_requests):
        payload = {"prompt": _prompt(rng, prompt_words, i), "max_tokens": max_tokens, "temperature": temperature,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": i,
                   "return_token_ids": True}
        tasks.append(asyncio.create_task(worker(i, payload)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    after = await get_text(host, port, "/metrics")
    ok = [r for r in results if r["status"] == 200 and not r.get("error")]
    d = lambda name, **kw: _metric(after, name, **kw) - _metric(before, name, **kw)  # noqa: E731
    drafts = d("vllm:spec_decode_num_drafts_total")
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency, "rate": None if rate == float("inf") else rate, "requests": num_requests, "ok": len(ok),
        "errors": [r.get("error") or r["status"] for r in results if r not in ok][:5],
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
        "output_tokens": out_tokens, "wall_s": wall,
        "throughput_tok_s": out_tokens / wall, "throughput_req_s": len(ok) / wall,
        "ttft_s": _summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_s": _summary([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_s": _summary([x for r in ok for x in r["itl"]]),
        "latency_s": _summary([r["latency"] for r in ok]),
        "server": {
            "engine_decode_steps": d("hyspec:engine_steps_total", kind="decode"),
            "engine_prefill_calls": d("hyspec:engine_steps_total", kind="prefill"),
            "spec_drafts": drafts,
            "spec_acceptance_rate": (d("vllm:spec_decode_num_accepted_tokens_total")
                                     / d("vllm:spec_decode_num_draft_tokens_total")) if drafts else None,
            "spec_tokens_per_round": (1 + d("vllm:spec_decode_num_accepted_tokens_total") / drafts) if drafts else None,
            "compilations_after_startup": d("hyspec:compilations_after_startup_total"),
        },
    }


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
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000); otherwise one is started per mode")
    p.add_argument("--model", help="model directory for started servers (default: hyspec serve's default)")
    p.add_argument("--modes", default="ar", help="comma-separated spec modes to start servers for (default ar)")
    p.add_argument("--drafter", help="drafter directory (speculative modes)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated in-flight bounds (default 1,4,16)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level (default 32)")
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrival rate, requests/s (default inf)")
    p.add_argument("--prompt-words", type=int, default=24, help="words per synthetic prompt (default 24)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos; default 64)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the levels (default 2)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write results as JSON (to PATH or stdout)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    rows: list[dict] = []

    def measure(host: str, port: int, mode: str) -> None:
        async def go():
            for i in range(args.warmup):
                await one_request(host, port, {"prompt": f"warm-up {i}", "max_tokens": 4, "stream": True,
                                               "stream_options": {"include_usage": True}})
            for c in levels:
                row = await run_level(host, port, concurrency=c, num_requests=args.num_requests, rate=args.rate,
                                      prompt_words=args.prompt_words, max_tokens=args.max_tokens, seed=args.seed,
                                      temperature=args.temperature)
                row["mode"] = mode
                rows.append(row)
                print_table([row], header=len(rows) == 1)
        asyncio.run(go())

    if args.url:
        u = urlsplit(args.url)
        mode = "server"
        try:
            cards = json.loads(asyncio.run(get_text(u.hostname, u.port or 80, "/v1/models")))
            mode = cards["data"][0].get("spec_mode", mode)
        except Exception:  # noqa: BLE001 - only a label
            pass
        measure(u.hostname, u.port or 80, mode)
    else:
        import tempfile
        for mode in [m for m in args.modes.split(",") if m]:
            log = Path(tempfile.mkdtemp(prefix="serve_load_")) / f"server-{mode}.log"
            proc, port = start_server(args, mode, log)
            try:
                measure("127.0.0.1", port, mode)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    meta = {"bench": "serve_load", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(),
            "args": {k: (None if v == float("inf") else v) for k, v in vars(args).items() if k != "json"}}
    try:
        import jax
        meta["device"] = str(jax.devices()[0].device_kind)
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
