"""Start-up compile time of `hyspec serve`'s whole program set at a geometry, cold and from the persistent cache.

    hyspec bench serve-compile [--config PATH | --tiny] [--spec-mode ar|chain|tree] [--max-batch 32]
                               [--max-model-len 4096] [--prefill-chunk 128] [--max-logprobs 20] [--json OUT.json]

The server compiles, before it listens, every program a request can reach: the prefill of each chunk shape
(`runtime.backend.prefill_shapes`), the decoding step (or speculative round) of each sampling flavour, and, with
logprobs on, the scoring forward of each prompt bucket up to the context (`runtime.scoring.Scorer`). This command
builds the same backend and scorer the server builds from the same options — over random weights of the geometry
(default Qwen3.8-27B, built on the device leaf by leaf as `bench/verify_scale.py` does; a speculative mode gets a
random DSpark drafter of `DrafterConfig.from_target`'s default shape) — and times their compile twice, each in a
fresh process: `cold` with an empty persistent compilation cache, then `cached` reading what the cold run wrote.
The [scale] targets: the whole set ≤ 120 s cold and ≤ 20 s from the cache.

Each phase's weights are built before its clock starts; a program's time is its first call (trace, lower,
compile or cache read, and one run on padding inputs), as the server's start-up log reports it. Each phase also
counts, from JAX's own cache events, the XLA compilations its programs asked of the persistent cache and how many of
them it found there (`cache`: requests, hits): the cached phase should find every one (0 compiled).
"""

from __future__ import annotations

import argparse
import json
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
                    help="as the server's option: > 0 compiles the scoring forward of every prompt bucket (default 20)")
    ap.add_argument("--compile-workers", type=int, metavar="N",
                    help="threads compiling side by side (default: the server's, $HYSPEC_COMPILE_WORKERS or the "
                         "host's cores up to 8 on a CPU, 1 on a GPU; 1: one program after another, each timed alone)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="weights (auto: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", metavar="DIR", help="persistent compilation cache of both phases (default: a new "
                    "empty temporary directory, removed afterwards)")
    ap.add_argument("--json", metavar="OUT.json", help="write OUT.json and OUT.md")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)        # one timed phase, in this process
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
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
                          decode_buckets(args, plain=args.spec_mode == "ar"))


def run_phase(args) -> dict:
    """One phase in this process: the cache at args.cache_dir, the weights, then every program's first call."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    from hyspec_jax.bench.verify_scale import make_mesh, random_params, resolve_config
    from hyspec_jax.compilation import enable_compilation_cache
    from hyspec_jax.config import resolve_dtype
    from hyspec_jax.runtime.scoring import Scorer

    enable_compilation_cache(args.cache_dir)
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
    programs, last = [], [time.perf_counter()]

    def done(msg: str) -> None:     # "<program> <seconds>s": the backend's own time for it (the scorer's: none)
        now = time.perf_counter()
        m = re.search(r"\s+([\d.]+)s$", msg)
        programs.append(dict(program=msg[:m.start()] if m else msg,
                             seconds=float(m.group(1)) if m else now - last[0]))
        last[0] = now
        bar.update(1)
    cache = _count_cache_events()
    t0 = last[0] = time.perf_counter()
    from hyspec_jax.compilation import compile_workers
    workers = args.compile_workers or compile_workers()
    backend.compile(done, workers=workers)
    if scorer is not None:
        scorer.compile(done)
    total_s = time.perf_counter() - t0
    bar.close()
    return dict(phase=args.phase, geometry=name, parameters=sum(x.size for x in jax.tree.leaves(params)),
                dtype=str(jax.tree.leaves(params)[0].dtype), mode=backend.mode, slots=backend.slots,
                kv_len=backend.kv_len, shapes=[list(s) for s in backend.shapes], init_s=init_s, total_s=total_s,
                compile_workers=workers, cache=dict(cache),
                programs=programs, meta=run_metadata())


def _child(argv: list[str], phase: str, cache_dir: str) -> dict:
    """One phase in a fresh process (a process reads the persistent cache only for programs it has not built)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "hyspec_jax.bench.serve_compile", *argv, "--phase", phase, "--cache-dir",
               cache_dir, "--phase-out", out.name]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
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
             f"prefill shapes {c['shapes']}; {c['parameters'] / 1e9:.2f} B parameters (random). Each phase in its "
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
    return "\n".join(lines) + "\n"


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
