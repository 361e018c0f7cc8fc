"""Bole's packed forest against the dense one: `hyspec bench packed-verify --json out.json`.

Under a batch-wide node budget C below B·N the engine verifies the selected nodes packed into C rows
(`TargetModel.verify(packed_rows=C)`, `tree.pack_nodes`): the row-wise work (embedding, projections, norms, MLP,
LM head) runs on C rows, the per-request parts (conv windows, GDN tree solve, tree attention) in the [B, N]
layout. This measures what that buys. For a geometry (default Qwen3.8-27B; `--config`, `--tiny`; random weights
built on the device as `hyspec bench verify-scale` builds them), every batch B, row width N and budget C (given as
fractions of B·N, `--fill`), a forest whose B rows hold C valid nodes in all (seeded random trees, depth ≤
`--depth`, the C nodes spread over the rows as evenly as the row width allows) is verified twice from the same
committed state (a prefix of `--prefix` tokens): dense (cost of B·N rows) and packed into C rows. Each time is the
median of `--repeats` calls after a warm-up (block_until_ready; logits and the commit factors, as the engine's
verify returns them); `max |Δ logit|` compares the two at the valid nodes (the same rows in products of another
shape: rounding only). The kernels are the engine's (`--kernels auto`: Pallas on an NVIDIA GPU).

    hyspec bench packed-verify --json packed_h200.json                       # 27B, B 8 / 32, N 32, fill ¼ ½ ¾
    hyspec bench packed-verify --tiny --batch 4 --nodes 8 --json out.json    # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hyspec_jax.bench.verify_scale import _ints, resolve_config


def _fractions(s: str) -> list[float]:
    try:
        out = sorted({float(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {s!r}") from None
    if not out or min(out) <= 0 or max(out) > 1:
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench packed-verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run, tests)")
    g.add_argument("--config", metavar="PATH", help="a config.json or model directory (default: Qwen3.8-27B)")
    ap.add_argument("--batch", type=_ints, default=[8, 32], metavar="B,..", help="batches (default 8,32)")
    ap.add_argument("--nodes", type=_ints, default=[32], metavar="N,..", help="row widths N (default 32)")
    ap.add_argument("--fill", type=_fractions, default=[0.25, 0.5, 0.75], metavar="F,..",
                    help="budgets C as fractions of B·N (default 0.25,0.5,0.75; 1 = no packing)")
    ap.add_argument("--prefix", type=int, default=512, metavar="P", help="committed tokens per request (default 512)")
    ap.add_argument("--depth", type=int, default=8, metavar="D", help="tree depth bound, edges (default 8)")
    ap.add_argument("--repeats", type=int, default=10, metavar="K", help="timed calls per program (default 10)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="auto: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                    help="the verify's kernels as the engine runs them (default auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT.json", help="write OUT.json and OUT.md")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def spread_forest(rng: np.random.Generator, batch: int, nodes: int, total: int, depth: int):
    """A [batch, nodes] forest with `total` valid nodes in all: row b holds ⌊total/batch⌋ or one more (at least the
    anchor, at most `nodes`), each a seeded random tree of depth ≤ min(depth, its size − 1)."""
    from hyspec_jax import tree as tree_lib

    if not batch <= total <= batch * nodes:
        raise ValueError(f"budget {total} outside [B = {batch}, B·N = {batch * nodes}]")
    sizes = [total // batch + (1 if b < total % batch else 0) for b in range(batch)]
    parents = [tree_lib.random_parents(rng, n, min(depth, n - 1)) for n in sizes]
    return tree_lib.pack_forest(parents, tree_lib.TreeShape(nodes, min(depth, nodes - 1)))


def measure(cfg, *, batches, nodes, fills, prefix: int, depth: int, repeats: int, dtype, kernel_impl: str,
            seed: int, progress: bool = True, on_row=None) -> list[dict]:
    """One row per (B, N, C): dense and packed verify times and their largest logit difference; a batch whose
    programs do not fit the device's memory gets rows that say so (`error`), and the next batch still runs.
    on_row(rows): called after every row (a partial report survives a run cut short)."""
    import jax
    from flax import nnx

    from hyspec_jax.bench.verify_scale import make_mesh, progress_bar, random_params

    mesh = make_mesh(1)
    graphdef, params, _ = random_params(cfg, dtype, seed, mesh)
    programs = {}

    def program(packed: int):
        if packed not in programs:
            programs[packed] = jax.jit(lambda p, st, tree, toks: nnx.merge(graphdef, p).verify(
                st, tree, toks, kernel_impl=kernel_impl, packed_rows=packed)[::2])
        return programs[packed]

    cells = [(B, N, f) for B in batches for N in nodes for f in fills]
    bar = progress_bar(len(cells), progress)
    rows: list[dict] = []
    try:
        for B in batches:
            try:
                _batch_rows(rows, cfg, B, nodes, fills, prefix=prefix, depth=depth, repeats=repeats, dtype=dtype,
                            seed=seed, mesh=mesh, program=program, params=params, bar=bar, on_row=on_row)
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                measured = {(r["batch"], r["nodes"], r["capacity"]) for r in rows}
                for N in nodes:
                    for f in fills:
                        C = _capacity(B, N, f)
                        if (B, N, C) not in measured:
                            rows.append(dict(batch=B, nodes=N, capacity=C, error="out of device memory"))
                            bar.update(1)
                if on_row is not None:
                    on_row(rows)
    finally:
        bar.close()
    return rows


def _capacity(B: int, N: int, fill: float) -> int:
    return max(B, min(B * N, int(round(fill * B * N))))


def _batch_rows(rows: list, cfg, B, nodes, fills, *, prefix, depth, repeats, dtype, seed, mesh, program, params,
                bar, on_row) -> None:
    """Append batch B's rows to `rows` as they are measured (an out-of-memory error leaves the earlier ones)."""
    import jax.numpy as jnp

    from hyspec_jax.runtime.calibrate import time_verify
    from hyspec_jax.bench.verify_scale import random_state

    state, _ = random_state(cfg, B, prefix + max(nodes), prefix, dtype, seed, mesh)
    for N in nodes:
        for f in fills:
            C = _capacity(B, N, f)
            rng = np.random.default_rng([seed, B, N, C])
            tree = spread_forest(rng, B, N, C, depth)
            toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
            t_dense, (l_dense, _) = time_verify(program(0), params, state, tree, toks, repeats=repeats)
            packed = C if C < B * N else 0
            t_packed, (l_packed, _) = time_verify(program(packed), params, state, tree, toks, repeats=repeats)
            valid = np.asarray(tree.valid)
            diff = float(np.max(np.abs(np.asarray(l_packed, np.float32)[valid]
                                       - np.asarray(l_dense, np.float32)[valid])))
            rows.append(dict(batch=B, nodes=N, capacity=C, rows_dense=B * N, rows_packed=packed or B * N,
                             dense_ms=round(1e3 * t_dense.median_s, 4), packed_ms=round(1e3 * t_packed.median_s, 4),
                             packed_over_dense=round(t_packed.median_s / t_dense.median_s, 4),
                             dense_spread=round(t_dense.spread, 4), packed_spread=round(t_packed.spread, 4),
                             max_abs_logit_diff=diff))
            bar.update(1)
            if on_row is not None:
                on_row(rows)


def markdown(report: dict) -> str:
    lines = [f"# Packed vs dense verify — {report['geometry']}, {report['device_kind']}, {report['dtype']}",
             "", f"`{report['command']}`", "",
             f"commit {report['commit']}, jax {report['jax']}, {report['time_utc']}; prefix {report['prefix']} tokens, "
             f"trees of depth ≤ {report['depth']}, kernels `{report['kernels']}`, median of {report['repeats']} calls.",
             "", "| B | N | C (valid nodes) | dense rows | packed rows | dense ms | packed ms | packed / dense | "
                 "max abs Δ logit |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['nodes']} | {r['capacity']} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['capacity']} | {r['rows_dense']} | {r['rows_packed']} | "
                     f"{r['dense_ms']:.3f} | {r['packed_ms']:.3f} | {r['packed_over_dense']:.2f} | "
                     f"{r['max_abs_logit_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.repeats < 1 or a.prefix < 1 or a.depth < 0:
        print("error: --repeats and --prefix must be >= 1, --depth >= 0", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp

    from hyspec_jax.bench.report import portable_command, run_metadata, write_report

    cfg, name = resolve_config(a.tiny, a.config)
    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32, "bfloat16": jnp.bfloat16,
             "float32": jnp.float32}[a.dtype]
    report = {**run_metadata(), "command": portable_command("hyspec bench packed-verify", argv or sys.argv[1:]),
              "geometry": name, "dtype": str(jnp.dtype(dtype)), "prefix": a.prefix, "depth": a.depth,
              "kernels": a.kernels, "repeats": a.repeats, "rows": []}

    def on_row(rows):
        write_report(dict(report, rows=list(rows)), a.json, markdown)
    try:
        report["rows"] = measure(cfg, batches=a.batch, nodes=a.nodes, fills=a.fill, prefix=a.prefix, depth=a.depth,
                                 repeats=a.repeats, dtype=dtype, kernel_impl=a.kernels, seed=a.seed,
                                 progress=not a.no_progress, on_row=on_row)
    except (ValueError, jax.errors.JaxRuntimeError) as e:
        print(f"hyspec bench packed-verify: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    write_report(report, a.json, markdown)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
