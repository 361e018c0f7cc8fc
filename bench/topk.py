"""The greedy tree build's per-level top-k: `hyspec bench topk --json out.json`.

For each beam width W (rows of one tree level) and each tiling of `pallas_kernels.topk.biased_topk_pallas`
(vocabulary chunks per row × warps per program; chunks > 1 adds a small merge launch), and for XLA's
lax.top_k + log-sum-exp (the reference): GPU time per call from a profiler trace (the sum of the call's GPU
operations), GPU operations per call (≈ launches), and whether indices and values equal the reference's and
the log-sum-exp is within 1e-5. The dispatcher's choice (`hyspec_jax.kernels.TOPK_CHUNKS / TOPK_WARPS`)
is marked. --interpret runs the kernels in Pallas interpret mode (CPU; checks only, no meaningful time).

--level: a whole greedy level of the engine's tree instead (`kernels.tree_level`: the top-k programs and the
select program, against XLA's `topk.tree_level_reference`), per batch size (--batch), with the GPU time of each
named kernel, and whether tokens and parents equal the reference's and scores (−inf: invalid) are within 1e-5.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TILINGS = ((1, 4), (1, 8), (1, 16), (4, 4), (8, 2), (8, 4), (16, 2), (16, 4), (32, 1), (32, 2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench topk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="OUT.json", help="results (a .md table next to it)")
    p.add_argument("--vocab", type=int, default=8192, help="logits per row (default: the embedded model's 8,192)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="beam widths W (rows of one level)")
    p.add_argument("--k", type=int, default=8, help="children per row (the tree's top-k)")
    p.add_argument("--tilings", nargs="+", default=[f"{c}:{w}" for c, w in TILINGS], metavar="CHUNKS:WARPS")
    p.add_argument("--reps", type=int, default=20, help="profiled calls per variant")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no GPU needed; no timing)")
    p.add_argument("--level", action="store_true",
                   help="time a whole greedy tree level (kernel pair against XLA) instead of the top-k tilings")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16], help="--level: batch rows B")
    p.add_argument("--width", type=int, default=16, help="--level: nodes kept (the next level's beam)")
    p.add_argument("--select-warps", type=int, nargs="*", default=[], metavar="N",
                   help="--level: also the kernel pair with the select program on N warps (default: by its size)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from hyspec_jax.bench.report import portable_command, run_metadata
    from hyspec_jax import kernels
    from hyspec_jax.pallas_kernels import topk

    gpu = jax.default_backend() == "gpu"
    if not gpu and not a.interpret:
        raise ValueError("bench topk times GPU kernels: run it on an NVIDIA GPU, or pass --interpret to check only")
    try:
        tilings = [tuple(int(x) for x in t.split(":")) for t in a.tilings]
        if any(len(t) != 2 for t in tilings):
            raise ValueError
    except ValueError:
        raise ValueError(f"--tilings takes CHUNKS:WARPS pairs, got {a.tilings}") from None
    if a.level:
        return _level(a, argv)
    rng = np.random.default_rng(0)
    rows = []
    bar = tqdm(total=len(a.rows) * (1 + len(tilings)), desc="bench topk", unit="variant")
    for W in a.rows:
        base = jnp.asarray(rng.standard_normal((1, a.vocab)) * 3, jnp.float32)
        bias = jnp.asarray(rng.standard_normal((1, W, a.vocab)), jnp.float32)
        ref = jax.block_until_ready(topk.biased_topk_reference(base, bias, a.k))
        fns = {"xla": (None, None, jax.jit(lambda x, b: topk.biased_topk_reference(x, b, a.k)))}
        for c, w in tilings:
            fns[f"pallas {c}x{w}"] = (c, w, jax.jit(lambda x, b, c=c, w=w: topk.biased_topk_pallas(
                x, b, k=a.k, chunks=c, num_warps=w, interpret=a.interpret)))
        for name, (c, w, fn) in fns.items():
            row = {"rows": W, "vocab": a.vocab, "k": a.k, "variant": name, "chunks": c, "warps": w,
                   "dispatch_choice": (c, w) == (kernels.TOPK_CHUNKS, kernels.TOPK_WARPS)}
            rows.append(_measure(row, fn, (base, bias), lambda out: (
                np.array_equal(np.asarray(out[1]), np.asarray(ref[1]))
                and np.array_equal(np.asarray(out[0]), np.asarray(ref[0]))
                and np.allclose(np.asarray(out[2]), np.asarray(ref[2]), rtol=1e-5, atol=1e-5)),
                gpu and not a.interpret, a.reps, per_kernel=False))
            bar.update(1)
    bar.close()
    report = {**run_metadata(), "command": portable_command("hyspec bench topk", argv or sys.argv[1:]),
              "interpret": a.interpret, "dispatch": {"chunks": kernels.TOPK_CHUNKS, "warps": kernels.TOPK_WARPS},
              "rows": rows}
    md = [f"# Tree-level top-k ({report['device_kind']}, k {a.k}, vocabulary {a.vocab})", "",
          f"`{report['command']}` — commit {report['commit']}. GPU µs: the call's GPU operations per call (profiler); "
          "ops: GPU operations per call (≈ launches). ✓: indices and values equal XLA's, log-sum-exp within 1e-5. "
          "**bold**: the dispatcher's choice.", "",
          "| rows W | variant | GPU µs | ops | equal |", "|---|---|---|---|---|"]
    for r in rows:
        name = f"**{r['variant']}**" if r["dispatch_choice"] else r["variant"]
        md.append(f"| {r['rows']} | {name} | {r.get('gpu_us', '—')} | {r.get('gpu_ops', '—')} | "
                  f"{r.get('error') or ('✓' if r.get('equal') else '✗')} |")
    return _write(a.json, report, md)


def _measure(row: dict, fn, args, equal, timed: bool, reps: int, per_kernel: bool) -> dict:
    """row, with whether fn(*args) equals the reference (`equal(out)`) and, timed, its GPU time; a variant that does
    not compile is a row with its error, not a crash."""
    import jax
    try:
        out = jax.block_until_ready(fn(*args))
        row["equal"] = bool(equal(out))
        if timed:
            row.update(_gpu_time(fn, args, reps, per_kernel))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def _gpu_time(fn, args, reps: int, per_kernel: bool) -> dict:
    """fn(*args)'s GPU time and operations per call from a profiler trace (after 3 warm calls); per_kernel: also
    each named kernel's µs per call, largest first."""
    import jax

    from hyspec_jax.bench.report import gpu_stream_events, profile_trace
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ev = gpu_stream_events(profile_trace(lambda: [jax.block_until_ready(fn(*args)) for _ in range(reps)]))
    out = {"gpu_us": round(sum(d for _, d, _ in ev) / reps / 1e3, 2), "gpu_ops": round(len(ev) / reps, 1)}
    if per_kernel:
        per: dict[str, int] = {}
        for _, d, n in ev:
            per[n] = per.get(n, 0) + d
        out["kernels_us"] = {n: round(d / reps / 1e3, 2) for n, d in sorted(per.items(), key=lambda kv: -kv[1])}
    return out


def _write(path: str, report: dict, md: list[str]) -> int:
    """The JSON and its .md table beside it; the table printed. 0 when every row equals the reference."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r.get("equal") for r in report["rows"]) else 1


def _level(a, argv) -> int:
    """--level: the rows W (beam) and batch sizes B of a greedy level, the kernel pair against XLA."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from hyspec_jax import kernels
    from hyspec_jax.bench.report import portable_command, run_metadata
    from hyspec_jax.pallas_kernels import topk

    timed = jax.default_backend() == "gpu" and not a.interpret
    impl = "interpret" if a.interpret else "pallas"
    rng = np.random.default_rng(0)
    rows = []
    bar = tqdm(total=len(a.rows) * len(a.batch) * (2 + len(a.select_warps)), desc="bench topk --level", unit="variant")
    for W in a.rows:
        for B in a.batch:
            logits = jnp.asarray(rng.standard_normal((B, 8, a.vocab)) * 3, jnp.bfloat16)
            bias = jnp.asarray(rng.standard_normal((B, W, a.vocab)), jnp.bfloat16)
            logrho = jnp.asarray(-np.abs(rng.standard_normal((B, W))), jnp.float32)
            logscore = logrho - jnp.asarray(np.abs(rng.standard_normal((B, W))), jnp.float32)
            logscore = jnp.where(jnp.asarray(rng.random((B, W)) < 0.9), logscore, -jnp.inf)   # invalid parents
            args = (logits, bias, logrho, logscore)
            fns = {"xla": jax.jit(lambda x, b, r, s: topk.tree_level_reference(x, 3, b, r, s, k=a.k, width=a.width)),
                   "pallas": jax.jit(lambda x, b, r, s: kernels.tree_level(x, 3, b, r, s, k=a.k, width=a.width,
                                                                           impl=impl))}
            chunks, warps = kernels.topk_tiling(a.vocab)
            for sw in a.select_warps:
                fns[f"pallas, select {sw} warps"] = jax.jit(
                    lambda x, b, r, s, sw=sw: topk.tree_level_pallas(
                        x, b, r, s, row=3, k=a.k, width=a.width, chunks=chunks,
                        num_warps=warps, select_warps=sw,
                        interpret=a.interpret))
            ref = jax.block_until_ready(fns["xla"](*args))
            for name, fn in fns.items():
                row = {"batch": B, "rows": W, "vocab": a.vocab, "k": a.k, "width": a.width, "variant": name}
                rows.append(_measure(row, fn, args, lambda out: (      # token, parent equal; score, rho close
                    all(np.array_equal(np.asarray(out[i]), np.asarray(ref[i])) for i in (0, 1))
                    and all(np.allclose(np.asarray(out[i]), np.asarray(ref[i]), rtol=1e-5, atol=1e-5) for i in (2, 3))),
                    timed, a.reps, per_kernel=True))
                bar.update(1)
    bar.close()
    report = {**run_metadata(), "command": portable_command("hyspec bench topk", argv or sys.argv[1:]),
              "interpret": a.interpret, "level": True, "rows": rows}
    md = [f"# A greedy tree level ({report['device_kind']}, k {a.k}, kept {a.width}, vocabulary {a.vocab})", "",
          f"`{report['command']}` — commit {report['commit']}. GPU µs: the level's GPU operations per call "
          "(profiler); ops: GPU operations per call (≈ launches); the kernels' own µs beside. ✓: tokens and "
          "parents equal XLA's, scores (−inf: invalid) within 1e-5.", "",
          "| batch B | beam W | variant | GPU µs | ops | kernels (µs) | equal |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ks = ", ".join(f"{n[:40]} {us}" for n, us in list(r.get("kernels_us", {}).items())[:4]) or "—"
        md.append(f"| {r['batch']} | {r['rows']} | {r['variant']} | {r.get('gpu_us', '—')} | "
                  f"{r.get('gpu_ops', '—')} | {ks} | {r.get('error') or ('✓' if r.get('equal') else '✗')} |")
    return _write(a.json, report, md)


if __name__ == "__main__":
    sys.exit(main())
