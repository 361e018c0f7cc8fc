"""Host overhead of `hyspec serve` per token, without a device: the real server over an instant backend.

    python -m hyspec_jax.bench.serve_overhead [--concurrency 1,8,32] [--num-requests 64] [--max-tokens 64]
        [--step-ms 1] [--tokens-per-step 1 | --tokens-per-step-max M] [--prefill-ms MS] [--host-us 0]
        [--base [LABEL=]DIR ...] [--variant LABEL=FLAGS ...] [--reps 2]
        [--profile DIR | --cprofile DIR] [--json OUT.json]

On a GPU the embedded model's decoding step is short (1-2 ms at batch 32), so the server's Python work per token
(the event loop: queue hand-off, detokenisation, SSE rendering, HTTP writes; the request loop's thread: the
scheduler's bookkeeping) decides throughput at high concurrency, and both compete for one GIL. This measures that
work alone: a server process built exactly as `hyspec serve` builds it (the real app, metrics, scheduler thread
and uvicorn / the HTTP server of the checkout) over a scripted backend whose "device" runs one step at a time,
each a wait of --step-ms that releases the GIL (the host waits for a GPU the same way), giving --tokens-per-step
tokens per slot per step (1: plain decoding; more: a speculative round's accepted tokens); --host-us adds busy
work holding the GIL to each dispatch (launching a jitted step). The tokens are a fixed passage of the embedded
model's tokenizer, so detokenisation costs what real text costs.

The load is `bench/serve_load.py`'s (the same client, streamed /v1/completions, `ignore_eos`), level by level.
Beside its numbers each level reports the server process's CPU time per generated token, split by thread (the
event loop's main thread, the request loop's thread, the rest), read from /proc, and how long the device waited
for the host per step (its next step dispatched after the last one ended).

--tokens-per-step-max M gives each request a uniform 1..M tokens a step instead, so the requests of a wave end on
different steps and their successors' prompts arrive one at a time, as under speculation; --prefill-ms sets the
scripted prefill call's device time. --variant LABEL=FLAGS runs another server of this checkout with more `hyspec
serve` flags (e.g. `--decode-buckets none`), alternated with the others. Each level also reports the prefill calls.

--base DIR also runs the server of another checkout (its `serve/` and `hyspec_jax/`, e.g. the commit the
current server replaced) over the same backend, alternated with this one --reps times: like for like.
--profile DIR samples each server with py-spy (`pip install py-spy`; all threads, only while holding the GIL)
during the levels and writes the collapsed stacks plus a summary (µs per token by thread and function);
--cprofile DIR runs each server under cProfile (every thread, its whole life) and summarises it per token.

A benchmark, not a test: it asserts nothing about speed. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# a passage of ordinary English: the scripted tokens (what a model streams costs the detokeniser this much)
PASSAGE = ("The history of the city begins with a small settlement on the river, where farmers and traders met to "
           "exchange grain, wool and tools. Over the following centuries the market grew into a town with walls, "
           "a church and a bridge of stone, and the people who lived there learned to read, to keep accounts and "
           "to argue about the price of bread. When the railway arrived the population doubled within a decade; "
           "factories rose along the water and new streets of brick houses covered the fields to the north. ")


# --- the server process ------------------------------------------------------------------------------------
def _bind_checkout(root: Path) -> None:
    """Import `hyspec_jax` from `root` and `hyspec_jax.serve` from `root/serve` (this process only), whatever
    the installed package maps them to. Call before anything imports hyspec_jax."""
    sys.path.insert(0, str(root))
    for name in [m for m in sys.modules if m == "hyspec_jax" or m.startswith("hyspec_jax.")]:
        del sys.modules[name]
    import hyspec_jax  # noqa: F401  (from root now)
    spec = importlib.util.spec_from_file_location("hyspec_jax.serve", root / "serve" / "__init__.py",
                                                  submodule_search_locations=[str(root / "serve")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hyspec_jax.serve"] = mod
    spec.loader.exec_module(mod)


def make_backend(slots: int, step_s: float, tokens_per_step: int, token_ids: list[int], prefill_chunk: int = 128,
                 host_s: float = 0.0, depth: int | None = None, tokens_max: int | None = None,
                 prefill_s: float | None = None, seed: int = 0):
    """A Backend whose device calls cost a GIL-free sleep: `dispatch` returns after host_s of busy work holding
    the GIL (what launching a jitted step costs the host) and queues a step of step_s on a serial "device" (it
    starts when the device is free: a GPU step in flight while the host works), `collect` waits for it to end,
    then gives tokens_per_step tokens of the passage to every active slot (`accepted`/`drafted` as a speculative
    round's when tokens_per_step > 1; with tokens_max, each active slot's step gives a uniform 1..tokens_max
    tokens instead, drawn per slot and step from `seed`: the requests of a wave then end on different steps, as a
    speculative round's accepted drafts make them); `prefill` queues a call of prefill_s (default step_s) on the
    device, and its first tokens wait for it when read. `device_idle` sums the time the device waited for a
    dispatch while a decoding step was in flight or just done: the host's share of the step period."""
    import numpy as np

    from hyspec_jax.runtime.backend import Backend, StepResult, prefill_shapes

    cycle = np.asarray(token_ids, np.int32)
    L, n = len(cycle), tokens_per_step
    width = tokens_max or n                             # the most tokens a step gives a slot
    round_depth = width - 1 if depth is None else depth     # the most a step may give is depth + 1 tokens
    prefill_s = step_s if prefill_s is None else prefill_s
    rng = np.random.default_rng(seed)

    class PendingTokens:
        """A prefill's first tokens on the scripted device: reading them (np.asarray, or an index as a loop
        that reads them at once does) waits until the prefill has run."""

        def __init__(self, ready: float, tokens: np.ndarray):
            self.ready, self.tokens = ready, tokens

        def _wait(self) -> np.ndarray:
            wait = self.ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return self.tokens

        def __array__(self, dtype=None, copy=None):
            return self._wait() if dtype is None else self._wait().astype(dtype)

        def __getitem__(self, i):
            return self._wait()[i]

    class InstantBackend(Backend):
        mode = "scripted"
        depth = round_depth
        hint_width = 0

        def __init__(self):        # no model: only what the request loop reads
            self.slots, self.kv_len, self.shapes = slots, 1 << 20, prefill_shapes(prefill_chunk, slots)
            self.pos = np.zeros(slots, np.int64)
            self.offsets = np.arange(width)
            self.free_at = 0.0            # when the device ends its last queued step
            self.device_idle = 0.0
            self.device_steps = 0
            self.device_busy = 0.0         # seconds of queued calls, steps and prefills
            self.prefill_calls = 0

        @staticmethod
        def sampling(*args):
            return None

        def compile(self, progress=None) -> None:
            pass

        def _queue(self, now: float, seconds: float = step_s) -> float:
            """Queue one call of `seconds` on the device at `now`; returns when it ends."""
            if now - self.free_at < 0.05:     # an idle gap between steps (a longer one: no requests, not counted)
                self.device_idle += max(0.0, now - self.free_at)
            self.free_at = max(now, self.free_at) + seconds
            self.device_busy += seconds
            self.device_steps += 1
            return self.free_at

        def prefill(self, slots_, tokens, valid, reset, sampling):
            ready = self._queue(time.perf_counter(), prefill_s)     # its tokens are read when it ends
            self.prefill_calls += 1
            first = np.zeros(len(slots_), np.int32)
            for i, b in enumerate(slots_):
                if b < slots:
                    if reset[i]:
                        self.pos[b] = (int(tokens[i, 0]) * 7) % L
                    first[i] = cycle[self.pos[b] % L]
                    self.pos[b] += 1
            return PendingTokens(ready, first)

        def dispatch(self, active, sampling, steps, stochastic, hint=None):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < host_s:
                pass
            idx = (self.pos[:, None] + self.offsets) % L
            toks = cycle[idx]
            per_slot = rng.integers(1, width + 1, slots) if tokens_max else np.full(slots, n)
            count = np.where(active, per_slot, 0).astype(np.int32)
            self.pos += count
            return self._queue(time.perf_counter()), StepResult(
                tokens=toks, count=count, accepted=np.maximum(count - 1, 0) if width > 1 else None,
                drafted=width - 1 if width > 1 else 0)

        def collect(self, handle):
            ready, res = handle
            wait = ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return res

    return InstantBackend()


def serve_main(argv: list[str]) -> int:
    """The server process (`--serve`): the checkout's app over the instant backend, on the checkout's HTTP server."""
    p = argparse.ArgumentParser(prog="serve_overhead --serve")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--depth", type=int)
    p.add_argument("--tokens-max", type=int)
    p.add_argument("--prefill-ms", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flags", default="", help="more `hyspec serve` flags, one string")
    p.add_argument("--host-us", type=float, default=0.0)
    p.add_argument("--switch-interval-ms", type=float)
    p.add_argument("--cprofile", type=Path, help="cProfile the server into PATH (written when it stops)")
    p.add_argument("--stats", type=Path, help="on SIGUSR1, write the device's idle time and steps to PATH")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    _bind_checkout(args.root.resolve())
    import logging

    from hyspec_jax.runtime.scheduler import Scheduler
    from hyspec_jax.serve import app as app_mod
    from hyspec_jax.serve import server as server_mod
    from hyspec_jax.serve.chat import ChatTemplate
    from hyspec_jax.serve.metrics import ServerMetrics
    from hyspec_jax.tokenizer import load_tokenizer

    sp = argparse.ArgumentParser()
    server_mod.add_arguments(sp)
    sargs = sp.parse_args(["--port", "0", "--max-batch", str(args.slots), "--max-queue", "256",
                           "--max-model-len", str(args.max_model_len)] + shlex.split(args.server_flags))
    if hasattr(server_mod, "check_args"):
        server_mod.check_args(sargs)
    logging.basicConfig(level=getattr(logging, sargs.log_level.upper()), format="[hyspec serve] %(message)s")
    tokenizer = load_tokenizer(args.tokenizer_dir)
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False).ids
    backend = make_backend(args.slots, args.step_ms / 1e3, args.tokens_per_step, ids, host_s=args.host_us / 1e6,
                           depth=args.depth, tokens_max=args.tokens_max, seed=args.seed,
                           prefill_s=None if args.prefill_ms is None else args.prefill_ms / 1e3)
    chat = ChatTemplate(args.tokenizer_dir, tokenizer)
    metrics = ServerMetrics("overhead", spec_depth=backend.depth)
    scheduler = Scheduler(backend, metrics, max_queue=sargs.max_queue)
    model = app_mod.ServedModel(name="overhead", root=str(args.tokenizer_dir), max_model_len=args.max_model_len,
                                vocab_size=tokenizer.get_vocab_size(), eos_token_ids=frozenset(),
                                mode=backend.mode, created=int(time.time()))
    if args.stats is not None:      # the parent reads the device's idle time per level (SIGUSR1: write it now)
        import signal as _signal
        seq = [0]

        def write_stats(*_):
            seq[0] += 1
            args.stats.write_text(json.dumps({"seq": seq[0], "device_idle_s": backend.device_idle,
                                              "device_steps": backend.device_steps,
                                              "device_busy_s": backend.device_busy,
                                              "prefill_calls": backend.prefill_calls}))
        _signal.signal(_signal.SIGUSR1, write_stats)
    profiles = []
    if args.cprofile is not None:      # Python 3.12's cProfile (sys.monitoring) sees every thread: one profile
        import cProfile
        profiles.append(cProfile.Profile())

    def started() -> None:
        for prof in profiles:
            prof.enable()
        scheduler.start()
        print(f"scheduler thread {scheduler._thread.native_id}", file=sys.stderr, flush=True)   # for thread_cpu
    if hasattr(app_mod, "build_app"):        # the FastAPI server
        opts = app_mod.FrontOptions(api_key=sargs.api_key, allowed_origins=sargs.allowed_origins,
                                    max_body_bytes=sargs.max_body_bytes,
                                    log_requests=not sargs.disable_log_requests, max_logprobs=0)
        server = app_mod.OpenAIServer(scheduler=scheduler, tokenizer=tokenizer, chat=chat, model=model,
                                      metrics=metrics, options=opts, scorer=None, version="overhead")
        app = app_mod.build_app(server)
        started()
        serve = lambda: server_mod._serve(sargs, server, app, chat)  # noqa: E731
    else:                       # the hand-written server (before the FastAPI rebuild)
        server = app_mod.OpenAIApp(scheduler=scheduler, tokenizer=tokenizer, chat=chat, model=model, metrics=metrics)
        started()
        serve = lambda: asyncio.run(server_mod._serve(sargs, server, scheduler, chat))  # noqa: E731
    try:
        return serve()
    finally:
        for prof in profiles:
            prof.disable()
            prof.dump_stats(str(args.cprofile))


# --- the driver --------------------------------------------------------------------------------------------
def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int, scheduler_tid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the threads of pid, by group: main (the event loop), scheduler (the
    request loop's thread), other."""
    out: dict[str, float] = collections.defaultdict(float)
    tck = _ticks()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        secs = (int(fields[11]) + int(fields[12])) / tck
        tid = int(task.name)
        group = "main" if tid == pid else "scheduler" if tid == scheduler_tid else "other"
        out[group] += secs
    return dict(out)


class ServerProc:
    def __init__(self, label: str, root: Path, args, log_dir: Path, cprofile: Path | None = None,
                 server_flags: str = "", seed: int = 0):
        self.label, self.log = label, log_dir / f"server_{label}.log"
        cmd = [sys.executable, "-m", "hyspec_jax.bench.serve_overhead", "--serve", "--root", str(root),
               "--tokenizer-dir", str(args.tokenizer_dir), "--slots", str(args.slots),
               "--step-ms", str(args.step_ms), "--tokens-per-step", str(args.tokens_per_step),
               "--host-us", str(args.host_us)]
        if args.depth is not None:
            cmd += ["--depth", str(args.depth)]
        if args.tokens_per_step_max is not None:
            cmd += ["--tokens-max", str(args.tokens_per_step_max)]
        if args.prefill_ms is not None:
            cmd += ["--prefill-ms", str(args.prefill_ms)]
        if server_flags:
            cmd += ["--server-flags", server_flags]
        cmd += ["--seed", str(seed)]
        if args.switch_interval_ms is not None:
            cmd += ["--switch-interval-ms", str(args.switch_interval_ms)]
        if cprofile is not None:
            cmd += ["--cprofile", str(cprofile)]
        self.stats = log_dir / f"stats_{label}.json"
        self.stats.unlink(missing_ok=True)       # a previous repetition's server wrote one
        cmd += ["--stats", str(self.stats)]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("HYSPEC_API_KEY", None)
        env.pop("VLLM_API_KEY", None)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + 120
        while True:
            text = self.log.read_text(errors="replace")
            m = re.search(r"on http://[\d.]+:(\d+)", text)
            if m:
                self.port = int(m.group(1))
                self.scheduler_tid = int(re.search(r"scheduler thread (\d+)", text).group(1))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"serve_overhead: the {label} server did not start:\n"
                                 + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        self.spy: subprocess.Popen | None = None

    def device_stats(self) -> dict:
        """The scripted device's idle time and step count so far (SIGUSR1, then the file it writes)."""
        old = json.loads(self.stats.read_text()).get("seq", 0) if self.stats.exists() else 0
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(500):
            try:
                got = json.loads(self.stats.read_text())
                if got["seq"] > old:
                    return got
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        raise SystemExit(f"serve_overhead: the {self.label} server did not report its device statistics")

    def start_profile(self, path: Path, rate: int) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.spy = subprocess.Popen([spy, "record", "--pid", str(self.proc.pid), "--format", "raw", "--threads",
                                     "--gil", "--rate", str(rate), "--nonblocking", "-o", str(path)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)
        if self.spy.poll() is not None:
            raise SystemExit(f"serve_overhead: py-spy failed: {self.spy.stderr.read().decode()[-500:]}")

    def stop_profile(self) -> None:
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)
            self.spy.wait(60)
            self.spy = None

    def stop(self) -> None:
        self.stop_profile()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def summarize_profile(path: Path, rate: int, tokens: int, top: int = 25) -> dict:
    """py-spy's collapsed stacks -> µs per token by thread (samples while holding the GIL) and the functions
    with the most self and inclusive time."""
    per_thread: dict[str, int] = collections.Counter()
    self_t: dict[str, int] = collections.Counter()
    incl: dict[str, int] = collections.Counter()
    us = 1e6 / rate / max(tokens, 1)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0]
        m = re.search(r'"([^"]*)"', thread) or re.search(r"\((0x[0-9a-f]+)\)", thread)
        tname = m.group(1) if m else thread
        frames = [re.sub(r"\s*\((.*/)?([^/]*?):\d+\)$", r" (\2)", f) for f in frames[1:]]
        per_thread[tname] += int(n)
        if frames:
            self_t[f"{tname}: {frames[-1]}"] += int(n)
        for f in set(frames):
            incl[f"{tname}: {f}"] += int(n)
    return {"us_per_token_by_thread": {k: round(v * us, 2) for k, v in per_thread.most_common()},
            "self_us_per_token": {k: round(v * us, 2) for k, v in self_t.most_common(top)},
            "inclusive_us_per_token": {k: round(v * us, 2) for k, v in incl.most_common(top * 2)}}


def summarize_cprofile(path: Path, tokens: int, top: int = 30) -> dict:
    """cProfile stats -> the functions with the most own time, µs per generated token (cProfile's
    own cost per call inflates functions called often; read it for where, not how much)."""
    import pstats
    st = pstats.Stats(str(path)).stats
    rows = sorted(((tt, ct, nc, f"{Path(f).name}:{line}({name})") for (f, line, name), (cc, nc, tt, ct, _) in
                   st.items()), reverse=True)[:top]
    total = sum(v[2] for v in st.values())
    return {"total_us_per_token": round(total * 1e6 / tokens, 2),
            "top": [{"function": name, "own_us_per_token": round(tt * 1e6 / tokens, 2),
                     "cum_us_per_token": round(ct * 1e6 / tokens, 2), "calls_per_token": round(nc / tokens, 3)}
                    for tt, ct, nc, name in rows]}


def measure(server: ServerProc, args, levels: list[int], profile_dir: Path | None, rep: int) -> list[dict]:
    from hyspec_jax.bench import serve_load as sl
    rows = []

    async def go():
        base = f"http://127.0.0.1:{server.port}"
        async with sl._client(base, None, max(levels)) as client:
            for i in range(2):
                await sl.one_request(client, {"prompt": f"warm-up {i}", "max_tokens": 4, "stream": True,
                                              "stream_options": {"include_usage": True}})
            for c in levels:
                prof = None
                if profile_dir is not None:
                    prof = profile_dir / f"{server.label}_c{c}_rep{rep}.txt"
                    server.start_profile(prof, args.profile_rate)
                cpu0 = thread_cpu(server.proc.pid, server.scheduler_tid)
                dev0 = server.device_stats()
                try:
                    row = await asyncio.wait_for(sl.run_level(
                        client, concurrency=c, num_requests=args.num_requests, rate=float("inf"), prompt_words=24,
                        max_tokens=args.max_tokens, seed=rep, temperature=0.0), args.level_timeout)
                except asyncio.TimeoutError:
                    raise SystemExit(f"serve_overhead: the {server.label} server did not finish concurrency {c} in "
                                     f"{args.level_timeout:g}s (log: {server.log})") from None
                cpu1 = thread_cpu(server.proc.pid, server.scheduler_tid)
                dev1 = server.device_stats()
                if prof is not None:
                    server.stop_profile()
                n = max(row["output_tokens"], 1)
                row["server_cpu_us_per_token"] = {k: round((cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) * 1e6 / n, 1)
                                                  for k in ("main", "scheduler", "other")}
                row["server_cpu_us_per_token"]["total"] = round(sum(row["server_cpu_us_per_token"].values()), 1)
                steps = max(dev1["device_steps"] - dev0["device_steps"], 1)
                idle = dev1["device_idle_s"] - dev0["device_idle_s"]
                busy = dev1["device_busy_s"] - dev0["device_busy_s"]
                row["device"] = {"steps": steps, "idle_us_per_step": round(idle * 1e6 / steps, 1),
                                 "prefill_calls": dev1["prefill_calls"] - dev0["prefill_calls"],
                                 "busy_fraction": round(busy / (busy + idle), 3) if busy + idle > 0 else 0.0}
                if prof is not None and prof.exists():
                    row["profile"] = {"file": prof.name, **summarize_profile(prof, args.profile_rate, n)}
                row.update(server=server.label, rep=rep)
                rows.append(row)
                cpu = row["server_cpu_us_per_token"]
                print(f"{server.label:<5} rep {rep} c={c:<3} {row['ok']:>3} ok {row['throughput_tok_s']:>8.0f} tok/s  "
                      f"TPOT p50 {row['tpot_s']['p50'] * 1e3:6.2f} ms  ITL p50 {row['itl_s']['p50'] * 1e3:6.2f} ms  "
                      f"server CPU/token {cpu['total']:6.1f} us (loop {cpu['main']:.1f}, "
                      f"scheduler {cpu['scheduler']:.1f})  device idle/step {row['device']['idle_us_per_step']:.0f} us",
                      file=sys.stderr, flush=True)
    asyncio.run(go())
    return rows


def summary_table(rows: list[dict]) -> list[dict]:
    """Per (server, concurrency): mean tok/s over reps, TPOT / ITL p50, server CPU µs per token."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["server"], r["concurrency"])].append(r)
    out = []
    for (label, c), rs in groups.items():
        mean = lambda f: sum(f(r) for r in rs) / len(rs)  # noqa: E731
        out.append({"server": label, "concurrency": c, "tok_s": [round(r["throughput_tok_s"], 1) for r in rs],
                    "tok_s_mean": round(mean(lambda r: r["throughput_tok_s"]), 1),
                    "tpot_p50_ms": round(mean(lambda r: r["tpot_s"]["p50"]) * 1e3, 3),
                    "itl_p50_ms": round(mean(lambda r: r["itl_s"]["p50"]) * 1e3, 3),
                    "cpu_us_per_token": {k: round(mean(lambda r: r["server_cpu_us_per_token"][k]), 1)
                                         for k in ("total", "main", "scheduler", "other")},
                    "device_idle_us_per_step": round(mean(lambda r: r["device"]["idle_us_per_step"]), 1),
                    "device_busy_fraction": round(mean(lambda r: r["device"]["busy_fraction"]), 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv:
        return serve_main(argv)
    p = argparse.ArgumentParser(prog="serve_overhead", description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring for what is measured.")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated in-flight bounds (default 1,8,32)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per level (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--slots", type=int, default=32, help="server batch slots (default 32)")
    p.add_argument("--step-ms", type=float, default=1.0,
                   help="the scripted device's step: a GIL-free wait, one step at a time (default 1 ms)")
    p.add_argument("--tokens-per-step", type=int, default=1,
                   help="tokens per slot per step (1: plain decoding; >1: a speculative round's; default 1)")
    p.add_argument("--depth", type=int, metavar="D",
                   help="the round's draft depth: a step may give up to D + 1 tokens, which the loop's dispatch-ahead "
                        "rule reads (a tree-ready round of the wide tree: 7; default tokens-per-step − 1)")
    p.add_argument("--tokens-per-step-max", type=int, metavar="M",
                   help="each request's step gives a uniform 1..M tokens instead (drawn per request and step, seeded "
                        "by the repetition): the requests of a wave end on different steps, as under speculation")
    p.add_argument("--prefill-ms", type=float, metavar="MS",
                   help="the scripted device's prefill call (default: --step-ms)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="another server of this checkout with more `hyspec serve` flags, e.g. "
                        "'queue8=--max-queue 8', alternated with the others (repeatable)")
    p.add_argument("--host-us", type=float, default=0.0,
                   help="busy work holding the GIL in each dispatch, as launching a jitted step costs (default 0)")
    p.add_argument("--tokenizer-dir", type=Path, default=REPO / "checkpoints" / "default",
                   help="directory with tokenizer.json (default: the embedded model's)")
    p.add_argument("--switch-interval-ms", type=float, metavar="MS",
                   help="sys.setswitchinterval of the server processes (default: Python's, 5 ms)")
    p.add_argument("--base", action="append", default=[], metavar="[LABEL=]DIR",
                   help="another checkout's root: its server over the same backend too, alternated (repeatable; "
                        "LABEL default: the directory name)")
    p.add_argument("--reps", type=int, default=2, help="alternated repetitions (default 2)")
    p.add_argument("--level-timeout", type=float, default=600, help="seconds a level may take (default 600)")
    p.add_argument("--profile", type=Path, metavar="DIR", help="sample the servers with py-spy into DIR")
    p.add_argument("--profile-rate", type=int, default=1000, help="py-spy samples per second (default 1000)")
    p.add_argument("--cprofile", type=Path, metavar="DIR",
                   help="cProfile the servers into DIR (every thread, the whole server lifetime; a summary per "
                        "generated token in the JSON; slows the servers down)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x]
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.num_requests < 1 or args.max_tokens < 2 or args.tokens_per_step < 1:
        p.error("--concurrency levels, --num-requests and --tokens-per-step must be >= 1, --max-tokens >= 2")
    most = args.tokens_per_step_max or args.tokens_per_step
    if args.tokens_per_step_max is not None and args.tokens_per_step_max < 1:
        p.error("--tokens-per-step-max must be >= 1")
    if args.prefill_ms is not None and args.prefill_ms < 0:
        p.error("--prefill-ms must be >= 0")
    if args.depth is not None and args.depth < most - 1:
        p.error(f"--depth must be >= the most tokens a step gives − 1 = {most - 1}: a step gives at most depth + 1 "
                f"tokens, got {args.depth}")
    if not (args.tokenizer_dir / "tokenizer.json").is_file():
        p.error(f"no tokenizer.json in {args.tokenizer_dir}")
    servers = [("new", REPO, "")]
    for j, item in enumerate(args.base):
        label, _, root = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
        if not (Path(root) / "serve" / "app.py").is_file():
            p.error(f"--base {root}: not a checkout root (no serve/app.py)")
        servers.append((label, Path(root).resolve(), ""))
    for item in args.variant:
        label, eq, flags = item.partition("=")
        if not eq or not label or label in {s[0] for s in servers}:
            p.error(f"--variant must be LABEL=FLAGS with a new label, got {item!r}")
        from hyspec_jax.serve.server import add_arguments
        vp = argparse.ArgumentParser(prog=f"--variant {label}", exit_on_error=False)
        add_arguments(vp)
        try:
            _, unknown = vp.parse_known_args(["--port", "0"] + shlex.split(flags))
        except (argparse.ArgumentError, ValueError) as e:
            p.error(f"--variant {label}: {e}")
        if unknown:
            p.error(f"--variant {label}: not `hyspec serve` flags: {' '.join(unknown)}")
        servers.append((label, REPO, flags))
    if args.profile is not None:
        if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
            p.error("--profile needs py-spy (pip install py-spy)")
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.cprofile is not None:
        args.cprofile.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="serve_overhead_"))
    rows: list[dict] = []
    cprofiles = []
    for rep in range(1, args.reps + 1):
        for label, root, flags in servers:
            cprof = None if args.cprofile is None else args.cprofile / f"{label}_rep{rep}"
            srv = ServerProc(label, root, args, log_dir, cprof, server_flags=flags, seed=rep)
            try:
                got = measure(srv, args, levels, args.profile, rep)
            finally:
                srv.stop()
            rows += got
            if cprof is not None and cprof.exists():
                tokens = sum(r["output_tokens"] for r in got) + 8      # + the warm-up requests'
                cprofiles.append({"server": label, "rep": rep, "file": cprof.name, **summarize_cprofile(cprof, tokens)})
    from hyspec_jax.bench.report import git_commit
    table = summary_table(rows)
    for t in table:
        print(f"{t['server']:<5} c={t['concurrency']:<3} {t['tok_s_mean']:>8.0f} tok/s {t['tok_s']}  "
              f"TPOT p50 {t['tpot_p50_ms']:.2f} ms  ITL p50 {t['itl_p50_ms']:.2f} ms  "
              f"CPU/token {t['cpu_us_per_token']}  device idle/step {t['device_idle_us_per_step']} us "
              f"(busy {t['device_busy_fraction']:.2f})", file=sys.stderr)
    if args.json:
        meta = {"bench": "serve_overhead", "command": "python -m hyspec_jax.bench.serve_overhead " + " ".join(argv),
                "commit": git_commit(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
        print(f"server logs: {log_dir}", file=sys.stderr)
        args.json.write_text(json.dumps({"meta": meta, "summary": table, "results": rows, "cprofile": cprofiles},
                                        indent=2, default=str)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
