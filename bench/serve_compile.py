"""Start-up compile time of `hyspec serve`'s whole program set at a geometry, cold and from the persistent cache.

    hyspec bench serve-compile [--config PATH | --tiny] [--spec-mode ar|chain|tree] [--max-batch 32]
                               [--max-model-len 4096] [--prefill-chunk 128] [--max-logprobs 20] [--json OUT.json]

The server compiles, before it listens, every program a request can reach: the prefill of each chunk shape
(`runtime.backend.prefill_shapes`), the decoding step (or speculative round) of each sampling flavour, and, with
logprobs on, the scoring forward of each length bucket up to the context (`runtime.scoring.Scorer`, `runtime.scoring.score_buckets`). This command
builds the same backend and scorer the server builds from the same options — over random weights of the geometry
(default Qwen3.8-27B, built on the device leaf by leaf as `bench/verify_scale.py` does; a speculative mode gets a
random DSpark drafter of `DrafterConfig.from_target`'s default shape) — and times their compile twice, each in a
fresh process: `cold` with an empty persistent compilation cache, then `cached` reading what the cold run wrote. As a
one-device server on a CPU, both also keep the traced and lowered programs on disk (`compilation.DiskCachedJit`;
`--no-program-cache`: not), so that the cached phase skips tracing and lowering too.
The [scale] targets: the whole set ≤ 120 s cold and ≤ 20 s from the cache.

Each phase's weights are built before its clock starts; a program's time is its first call (trace, lower,
compile or cache read, and one run on padding inputs), as the server's start-up log reports it. Each phase also
counts, from JAX's own cache events, the XLA compilations its programs asked of the persistent cache and how many of
them it found there (`cache`: requests, hits): the cached phase should find every one (0 compiled).

Where each program's time goes ([startup]): JAX's own compile events (`jax.monitoring` time spans of tracing, lowering
to StableHLO — Pallas kernels lower to Triton / Mosaic IR here — and XLA's compile or cache read) and XLA's per-pass
timers (its `hlo_pass_pipeline` log, on in the child processes) split it into trace, lower, XLA's HLO passes, the
autotuner (the passes that time kernel candidates on the device), code generation (the rest of XLA's compile: LLVM,
PTX and the Triton / Pallas kernels' compiles) and the rest (the first run, host work). Per program with
`--compile-workers 1` (a GPU's default: the programs compile one after another); side by side, per phase only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from hyspec_jax.bench.report import portable_command, run_metadata, write_report

TARGET_COLD_S, TARGET_CACHED_S = 120.0, 20.0
PHASES = ("cold", "cached")
# jax.monitoring events of `compiler.compile_or_get_cached`: an XLA compilation that looked in the persistent cache,
# and one that found its program there (the others compiled and wrote it)
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _count_cache_events() -> dict[str, int]:
    """Counts of this process's persistent-cache requests and hits from now on (a live dict; compile threads
    included)."""
    import threading

    from jax import monitoring
    counts, lock = {"requests": 0, "hits": 0}, threading.Lock()

    def on_event(event: str, **_) -> None:
        key = {CACHE_REQUEST_EVENT: "requests", CACHE_HIT_EVENT: "hits"}.get(event)
        if key is not None:
            with lock:
                counts[key] += 1
    monitoring.register_event_listener(on_event)
    return counts


# XLA's per-pass timers: its C++ log at verbosity 1 for hlo_pass_pipeline.cc only (set before XLA loads: in the child's
# environment), written to the phase's log file (the child points its fd 2 there)
XLA_LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1"}
# JAX's compile stages (`jax._src.dispatch`'s event names), each a time span in the thread doing it
STAGE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                "/jax/core/compile/backend_compile_duration": "xla"}
# the passes that time kernel candidates on the device (GEMM / fusion / convolution autotuners)
AUTOTUNE_PASS = re.compile(r"autotun|algorithm[-_ ]picker", re.IGNORECASE)
SPLIT_KEYS = ("trace", "lower", "passes", "autotune", "codegen", "rest")
_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d+)\s+(\d+) (\S+?):\d+\] (.*)$")
_PASS = re.compile(r"^HLO pass: (.+?) time: ([\d.]+) ?(ns|us|µs|ms|s)\b")
_PIPELINE = re.compile(r"^Running HLO pass pipeline on module \S+: (.+)$")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def _record_stage_spans() -> list[tuple[str, float, float, int]]:
    """A live list of this process's compile-stage spans from now on: (stage, start, end, native thread id), the
    epoch times of `time.time()`, each recorded in the thread that did the work (compile threads included)."""
    import threading

    from jax import monitoring
    spans: list[tuple[str, float, float, int]] = []

    def on_span(event: str, start: float, end: float, **_) -> None:
        stage = STAGE_EVENTS.get(event)
        if stage is not None:
            spans.append((stage, start, end, threading.get_native_id()))   # list.append: atomic under the GIL
    monitoring.register_event_time_span_listener(on_span)
    return spans


def parse_xla_passes(lines, year: int) -> list[tuple[float, float, int, str]]:
    """XLA's pass timers from its log (`XLA_LOG_ENV`): (start, end, native thread id, pass name) per leaf pass run,
    epoch seconds (the log's local time). A pipeline nested in another is logged as one of its passes too: those
    are dropped, so that no time counts twice."""
    runs, pipelines = [], set()
    for line in lines:
        m = _GLOG.match(line.rstrip("\n"))
        if m is None or m.group(8) != "hlo_pass_pipeline.cc":
            continue
        msg = m.group(9)
        p = _PIPELINE.match(msg)
        if p is not None:
            pipelines.add(p.group(1).strip())
            continue
        q = _PASS.match(msg)
        if q is None:
            continue
        mo, d, h, mi, sec, frac = (m.group(i) for i in range(1, 7))
        end = time.mktime((year, int(mo), int(d), int(h), int(mi), int(sec), 0, 0, -1)) + float("0." + frac)
        runs.append((end - float(q.group(2)) * _UNIT_S[q.group(3)], end, int(m.group(7)), q.group(1)))
    return [r for r in runs if r[3] not in pipelines]


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by these intervals (a jit traced or compiled inside another counts once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def split_time(spans, passes, start: float, end: float, seconds: float | None = None) -> dict[str, float]:
    """Where the time between start and end went, in thread-seconds (each thread's stages merged, then summed
    over threads): trace, lower, XLA's HLO passes, its autotuner, its code generation (XLA's compile less its
    passes) and, given the wall `seconds` of a program compiled alone, the rest (its first run, host work)."""
    def clipped(a: float, b: float) -> tuple[float, float] | None:
        a, b = max(a, start), min(b, end)
        return (a, b) if b > a else None

    out = {}
    for stage in ("trace", "lower", "xla"):
        by_thread: dict[int, list] = {}
        for st, a, b, tid in spans:
            c = clipped(a, b) if st == stage else None
            if c is not None:
                by_thread.setdefault(tid, []).append(c)
        out[stage] = sum(_union_seconds(v) for v in by_thread.values())
    tuned = total = 0.0
    for a, b, _, name in passes:
        c = clipped(a, b)
        if c is not None:
            total += c[1] - c[0]
            tuned += c[1] - c[0] if AUTOTUNE_PASS.search(name) else 0.0
    xla = out.pop("xla")
    out.update(passes=total - tuned, autotune=tuned, codegen=max(0.0, xla - total))
    if seconds is not None:
        out["rest"] = max(0.0, seconds - out["trace"] - out["lower"] - xla)
    return {k: round(v, 3) for k, v in out.items()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench serve-compile", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run, tests)")
    g.add_argument("--config", metavar="PATH", help="a config.json or model directory (default: Qwen3.8-27B)")
    ap.add_argument("--spec-mode", choices=("ar", "chain", "tree"), default="ar",
                    help="the server's mode (chain / tree: a random DSpark drafter; default ar)")
    ap.add_argument("--max-batch", type=int, default=32, metavar="B", help="slots (default 32)")
    ap.add_argument("--decode-buckets", default="auto", metavar="R,R,...",
                    help="as `hyspec serve --decode-buckets` (default auto: the server's own)")
    ap.add_argument("--max-model-len", type=int, default=4096, metavar="S", help="context per slot (default 4096)")
    ap.add_argument("--prefill-chunk", type=int, default=128, metavar="T", help="prefill token budget (default 128)")
    ap.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                    help="as the server's option: > 0 compiles the scoring forward of every length bucket (default 20)")
    ap.add_argument("--compile-workers", type=int, metavar="N",
                    help="threads compiling side by side (default: the server's, $HYSPEC_COMPILE_WORKERS or the "
                         "host's cores up to 8 on a CPU, 1 on a GPU; 1: one program after another, each timed alone)")
    ap.add_argument("--no-program-cache", dest="program_cache", action="store_false",
                    help="as `hyspec serve --no-compilation-cache` for the traced programs: a CPU server keeps its "
                         "traced and lowered programs on disk beside the compilation cache (`compilation."
                         "DiskCachedJit`); this leaves them out, so the cached phase traces and lowers every program")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="weights (auto: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", metavar="DIR", help="the caches of both phases: DIR/xla the persistent compilation "
                    "cache, DIR/programs the traced programs (default: a new empty temporary directory, removed "
                    "afterwards)")
    ap.add_argument("--json", metavar="OUT.json", help="write OUT.json and OUT.md")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)        # one timed phase, in this process
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    ap.add_argument("--xla-log", help=argparse.SUPPRESS)     # where the child's fd 2 (XLA's C++ log) goes
    return ap


def _backend(args, cfg, model, dtype):
    """The server's backend for these options (`serve.server.build_backend`'s shapes and lengths), over `model`."""
    from hyspec_jax.config import DrafterConfig
    from hyspec_jax.models.drafter import create_drafter
    from hyspec_jax.runtime.backend import prefill_shapes
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    from hyspec_jax.tree import TreeExpansion

    from hyspec_jax.serve.server import decode_buckets
    shapes = prefill_shapes(args.prefill_chunk, args.max_batch)
    if args.spec_mode == "ar":
        engine = Engine(model, slots=args.max_batch)
    else:
        drafter = create_drafter(DrafterConfig.from_target(cfg), seed=args.seed + 1, dtype=dtype)
        spec = (SpecConfig(mode="tree", tree=TreeExpansion(depth=4, top_k=2, beam=4)) if args.spec_mode == "tree"
                else SpecConfig(mode="chain"))
        engine = Engine(model, drafter, spec, slots=args.max_batch)
    return engine.backend(args.max_batch, args.max_model_len + engine.overshoot, shapes,
                          decode_buckets(args, plain=args.spec_mode == "ar"), logprobs=args.max_logprobs)


def run_phase(args) -> dict:
    """One phase in this process: the cache at args.cache_dir, the weights, then every program's first call."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    from hyspec_jax.bench.verify_scale import make_mesh, random_params, resolve_config
    from hyspec_jax.compilation import CACHE_ENV, enable_compilation_cache, enable_program_cache
    from hyspec_jax.config import resolve_dtype
    from hyspec_jax.runtime.scoring import Scorer, compile_server

    os.environ[CACHE_ENV] = os.path.join(args.cache_dir, "xla")    # this process's: the traced programs beside it
    enable_compilation_cache()
    programs_kept = enable_program_cache(args.program_cache)     # as a one-device server's (on a CPU only)
    cfg, name = resolve_config(args.tiny, args.config)
    dtype = resolve_dtype(args.dtype)
    t0 = time.perf_counter()
    graphdef, params, _ = random_params(cfg, dtype, args.seed, make_mesh(1))
    jax.block_until_ready(params)
    model = nnx.merge(graphdef, params)
    backend = _backend(args, cfg, model, dtype)
    init_s = time.perf_counter() - t0
    scorer = Scorer(backend.graphdef, backend.params, args.max_model_len, args.max_logprobs) \
        if args.max_logprobs > 0 else None
    total = len(backend.shapes) + 2 + (len(scorer.buckets) if scorer else 0)
    bar = tqdm(total=total, desc=f"serve-compile {args.phase}", unit="program", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    programs, last = [], [time.perf_counter(), time.time()]
    windows: list[tuple[float, float]] = []       # each program's (start, end), epoch

    def done(msg: str) -> None:     # "<program> <seconds>s": the backend's own time for it (the scorer's: none)
        now, wall = time.perf_counter(), time.time()
        m = re.search(r"\s+([\d.]+)s$", msg)
        programs.append(dict(program=msg[:m.start()] if m else msg,
                             seconds=float(m.group(1)) if m else now - last[0]))
        windows.append((last[1], wall))
        last[0], last[1] = now, wall
        bar.update(1)
    cache = _count_cache_events()
    spans = _record_stage_spans()
    from hyspec_jax.compilation import compile_workers
    workers = args.compile_workers or compile_workers()
    t0 = last[0] = time.perf_counter()
    start = last[1] = time.time()
    compile_server(backend, scorer, done, workers)
    total_s, end = time.perf_counter() - t0, time.time()
    bar.close()
    passes = None
    if args.xla_log:
        sys.stderr.flush()
        with open(args.xla_log, errors="replace") as f:
            passes = parse_xla_passes(f, time.localtime(start).tm_year)
    split = functools.partial(split_time, spans, passes or [])
    if workers == 1:        # one program after another: each program's window is its own
        for prog, (a, b) in zip(programs, windows):
            prog["split"] = split(a, b, prog["seconds"])
    return dict(phase=args.phase, geometry=name, parameters=sum(x.size for x in jax.tree.leaves(params)),
                dtype=str(jax.tree.leaves(params)[0].dtype), mode=backend.mode, slots=backend.slots,
                kv_len=backend.kv_len, shapes=[list(s) for s in backend.shapes], init_s=init_s, total_s=total_s,
                compile_workers=workers, cache=dict(cache), program_cache=programs_kept,
                split=split(start, end, total_s if workers == 1 else None), xla_passes=passes is not None,
                programs=programs, meta=run_metadata())


def _child(argv: list[str], phase: str, cache_dir: str) -> dict:
    """One phase in a fresh process (a process reads the persistent cache only for programs it has not built)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out, \
            tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        cmd = [sys.executable, "-m", "hyspec_jax.bench.serve_compile", *argv, "--phase", phase, "--cache-dir",
               cache_dir, "--phase-out", out.name, "--xla-log", log.name]
        proc = subprocess.run(cmd, env={**os.environ, **XLA_LOG_ENV})
        if proc.returncode != 0:
            tail = [ln.rstrip() for ln in open(log.name, errors="replace")][-10:]     # XLA's last words, if any
            print("\n".join(tail), file=sys.stderr)
            raise RuntimeError(f"the {phase} phase failed (exit {proc.returncode})")
        return json.loads(open(out.name).read())


def _compiles(phase: dict) -> str:
    cache = phase.get("cache")          # absent from reports written before it was counted
    return "-" if cache is None else f"{cache['requests'] - cache['hits']} / {cache['hits']}"


def markdown(report: dict) -> str:
    c, w = report["phases"]["cold"], report["phases"]["cached"]
    meta = c["meta"]
    lines = [f"# `hyspec serve` start-up compile — {c['geometry']}, {meta['device_kind']}, {c['dtype']}", "",
             f"`{report['command']}`", "",
             f"commit {meta['commit']}, jax {meta['jax']}; mode {c['mode']}, {c['slots']} slots, KV {c['kv_len']}, "
             f"prefill shapes {c['shapes']}; {c['parameters'] / 1e9:.2f} B parameters (random); traced programs kept on "
             f"disk (`DiskCachedJit`): {'yes' if c.get('program_cache') else 'no'}. Each phase in its "
             f"own process; a program's time is its first call (trace, lower, compile or cache read, one run)" +
             (f"; the programs compile on {c['compile_workers']} threads side by side, so their times overlap "
              f"(each is its compile in its thread) and add up to more than the total."
              if c.get("compile_workers", 1) > 1 else "."), "",
             "| phase | programs | XLA compiles: compiled / read from the cache | total s | target s | "
             "weights built (s, not counted) |",
             "|---|---:|---:|---:|---:|---:|",
             f"| cold (empty cache) | {len(c['programs'])} | {_compiles(c)} | {c['total_s']:.1f} | "
             f"≤ {TARGET_COLD_S:.0f} | {c['init_s']:.1f} |",
             f"| from the persistent cache | {len(w['programs'])} | {_compiles(w)} | {w['total_s']:.1f} | "
             f"≤ {TARGET_CACHED_S:.0f} | {w['init_s']:.1f} |", "",
             "| program | cold s | cached s |", "|---|---:|---:|"]
    cached = {b["program"]: b["seconds"] for b in w["programs"]}
    for a in c["programs"]:
        b = cached.get(a["program"])
        lines.append(f"| {a['program']} | {a['seconds']:.1f} | {'-' if b is None else f'{b:.1f}'} |")
    if "split" in c:                    # reports written before the split have none
        lines += ["", *split_tables(c, w)]
    return "\n".join(lines) + "\n"


_SPLIT_HEAD = ("trace | lower | XLA's HLO passes | autotuning | code generation (LLVM, PTX, Triton / Pallas kernels) | "
               "rest (first run, host)")


def split_tables(c: dict, w: dict) -> list[str]:
    """Markdown: where each phase's and (compiled one after another) each program's time went."""
    def cells(d: dict) -> str:
        return " | ".join("-" if d.get(k) is None else f"{d[k]:.1f}" for k in SPLIT_KEYS)

    out = ["## Where the time goes (s)", "",
           "Trace and lower: JAX's compile events; XLA's passes and its autotuner: XLA's per-pass timers (its "
           "`hlo_pass_pipeline` log); code generation: the rest of XLA's compile (or, from the cache, the read); rest: "
           "the program's time less those (its first run and host work)." +
           ("" if c.get("xla_passes") else " XLA's pass timers were not read: passes count under code generation."),
           "", f"| phase | {_SPLIT_HEAD} |", "|---|" + "---:|" * len(SPLIT_KEYS)]
    for label, ph in (("cold", c), ("from the persistent cache", w)):
        out.append(f"| {label} | {cells(ph['split'])} |")
    if not any("split" in p for p in c["programs"]):
        return out + ["", f"Per program only with `--compile-workers 1` (this run: {c['compile_workers']} threads)."]
    cached = {p["program"]: p.get("split") for p in w["programs"]}
    out += ["", f"| program, cold / cached | {_SPLIT_HEAD} |", "|---|" + "---:|" * len(SPLIT_KEYS)]
    for p in c["programs"]:
        out.append(f"| {p['program']} | {cells(p['split'])} |")
        if cached.get(p["program"]):
            out.append(f"| (cached) | {cells(cached[p['program']])} |")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for name in ("max_batch", "max_model_len"):
        if getattr(args, name) < 1:
            print(f"serve-compile: error: --{name.replace('_', '-')} must be ≥ 1", file=sys.stderr)
            return 2
    from hyspec_jax.serve.server import decode_buckets
    try:
        decode_buckets(args)
    except ValueError as e:
        print(f"serve-compile: error: {e}", file=sys.stderr)
        return 2
    if args.phase:                                   # a child: one phase, its result to --phase-out
        if args.xla_log:        # XLA logs to fd 2: point it at the log file, Python's stderr stays the terminal
            keep = os.dup(2)
            fd = os.open(args.xla_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.close(fd)
            sys.stderr = os.fdopen(keep, "w", buffering=1)
        from hyspec_jax.config import ConfigError
        try:
            result = run_phase(args)
        except (ConfigError, ValueError, OSError) as e:
            print(f"serve-compile: error: {e}", file=sys.stderr)
            return 1
        with open(args.phase_out, "w") as f:
            json.dump(result, f, default=str)
        return 0
    own = args.cache_dir is None
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="hyspec_serve_compile_")
    try:
        phases = {p: _child(argv, p, cache_dir) for p in PHASES}
    except RuntimeError as e:
        print(f"serve-compile: error: {e}", file=sys.stderr)
        return 1
    finally:
        if own:
            import shutil
            shutil.rmtree(cache_dir, ignore_errors=True)
    report = dict(command=portable_command("hyspec bench serve-compile", argv), phases=phases,
                  targets=dict(cold_s=TARGET_COLD_S, cached_s=TARGET_CACHED_S),
                  met=dict(cold=phases["cold"]["total_s"] <= TARGET_COLD_S,
                           cached=phases["cached"]["total_s"] <= TARGET_CACHED_S))
    print(markdown(report))
    if write_report(report, args.json, markdown):
        print(f"[serve-compile] wrote {args.json} and its .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
