"""Routed MoE at scale (issue [scale], item 4): one sparse-MoE block per layer, each execution form against its floor.

    hyspec bench moe-scale [--tokens 1,8,32,256] [--forms gather,dense] [--layers L|fit]
                           [--repeats K] [--json OUT.json] [--tiny] ...
    python -m hyspec_jax.bench.moe_scale ...        (same options)

The Qwen3-Next-80B-A3B geometry (docs/reference/target_model.md §15: hidden 2048, 512 experts, top 10,
moe_intermediate 512, shared expert 512, norm_topk_prob; or `--tiny`), RANDOM weights drawn as the model's own
initialiser draws them (bench/verify_scale.py's `INIT_RULES` and per-leaf fillers, created on the device), in
bf16 on GPU. One program per (form, T) runs L distinct layers' `SparseMoe` blocks (router + routed experts +
sigmoid-gated shared expert) one after another on T rows, x ← x + block_l(x) — L layers so that the chosen
experts' weights do not sit in the L2 cache between calls, and one launch is amortised over L blocks. Reported
per layer = median program time / L (`calibrate.median_time`: warm-up calls, then `--repeats` calls).

Token counts stand for decode of B = 1 / 8 / 32 requests and a verify of 256 rows. Forms (`hyspec_jax.moe`):
gather (only the chosen experts' weights gathered; skipped where that copy would exceed --gather-max-gib),
dense (every expert). "rule" marks the form `moe.choose_form` picks for T.

Floors per layer, from the routes the run really took (every layer's top-k of its own input): bytes = the
distinct experts chosen × one expert's bytes + router + shared expert; FLOPs = 2·T·(k·3·I·H + E·H + 3·S·H);
floor = max(bytes / bandwidth, FLOPs / matmul rate), with bandwidth and matmul rate measured in the same run
(bench/kernels.py `copy_bandwidth` / `matmul_peak`; --bandwidth / --matmul-rate override). Every output is checked
finite and compared with the dense form's twice (max |diff| / max |dense block|): the first layer's block alone on
the same input — the forms' own arithmetic, ~1 bf16 ulp apart — and after all L layers, reported only: there the
bf16 rounding of the residual stream x (an ulp of |x| is large beside one block's output) and the top-k choices it
flips compound to several percent in any form (in bf16 on CPU, gather and dense land equally far from an fp32 run
of the same weights).

A program whose first call takes more than --max-call-s is timed by that one call; with --max-seconds S no
further program is timed once S seconds have passed (status "partial", the rest listed as skipped).

Outputs (--json OUT.json): OUT.json (run_metadata: device, versions, commit; the command; every number) and
OUT.md (the table). Exit status 1 if an output is non-finite or a form's one block differs from dense's by more
than BLOCK_TOL.

On the GPU machine (not pip-installed; bench/verify_scale.py's convention), one H100 or H200, 8 layers (24 GiB of
bf16 experts), --max-seconds keeping the run inside 3 minutes:

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.moe_scale --max-seconds 150 --json $OUT/moe_scale.json

CPU smoke run: `--tiny`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hyspec_jax.runtime.calibrate import _ints, median_time

DEFAULT_TOKENS = (1, 8, 32, 256)
TOKEN_ROLE = {1: "decode B=1", 8: "decode B=8", 32: "decode B=32", 256: "verify 256 rows"}
GIB = 2 ** 30
BLOCK_TOL = 2 ** -5       # one block vs dense, relative max: 8 bf16 ulps; a wrong expert or weight is O(1)


class UsageError(Exception):
    """A request the device cannot meet (e.g. --layers fit without memory stats): one line, exit status 2."""


def qwen3_next_80b_a3b():
    """Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults, docs/reference/target_model.md §15). Only
    the MoE fields matter here; the rest make a valid config."""
    from hyspec_jax.config import FULL, LINEAR, TargetConfig

    return TargetConfig(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(48)),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True)


def tiny_config():
    """The same shape family, small enough for a CPU test (T·k crosses E between the token counts)."""
    import dataclasses

    return dataclasses.replace(qwen3_next_80b_a3b(), vocab_size=64, hidden_size=64, num_experts=16,
                               num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               num_attention_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=16, linear_value_head_dim=16)


# ------------------------------------------------------------------------------------------------
# Work and floors
# ------------------------------------------------------------------------------------------------
def expert_bytes(cfg, itemsize: int) -> int:
    """One routed expert's weights: gate, up [I, H] and down [H, I]."""
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * itemsize


def fixed_bytes(cfg, itemsize: int) -> int:
    """What every call reads whatever the routes: router [E, H], shared expert (3·S·H) and its gate [1, H]."""
    H = cfg.hidden_size
    return (cfg.num_experts * H + 3 * cfg.shared_expert_intermediate_size * H + H) * itemsize


def block_flops(cfg, tokens: int, experts_per_token: int) -> int:
    """Matmul FLOPs of one block on `tokens` rows with `experts_per_token` experts run per row (k routed: the
    work of a routed form; E: the dense form's)."""
    H = cfg.hidden_size
    per_row = (experts_per_token * 3 * cfg.moe_intermediate_size * H + cfg.num_experts * H
               + 3 * cfg.shared_expert_intermediate_size * H + H)
    return 2 * tokens * per_row


def gather_bytes(cfg, tokens: int, itemsize: int) -> int:
    """The gather form's copy of the chosen experts' weights (duplicates included)."""
    return tokens * cfg.num_experts_per_tok * expert_bytes(cfg, itemsize)


def floors(cfg, tokens: int, distinct: list[int], itemsize: int, bandwidth: float, rate: float) -> dict:
    """Per-layer floors from the distinct experts each layer chose, and the dense form's own floor."""
    routed_bytes = float(np.mean(distinct)) * expert_bytes(cfg, itemsize) + fixed_bytes(cfg, itemsize)
    flops = block_flops(cfg, tokens, cfg.num_experts_per_tok)
    dense_bytes = cfg.num_experts * expert_bytes(cfg, itemsize) + fixed_bytes(cfg, itemsize)
    dense_flops = block_flops(cfg, tokens, cfg.num_experts)
    ms = lambda b, f: 1e3 * max(b / bandwidth, f / rate)
    return {"distinct_experts_mean": float(np.mean(distinct)), "bytes": routed_bytes, "flops": flops,
            "memory_floor_ms": 1e3 * routed_bytes / bandwidth, "compute_floor_ms": 1e3 * flops / rate,
            "floor_ms": ms(routed_bytes, flops), "dense_bytes": dense_bytes, "dense_flops": dense_flops,
            "dense_floor_ms": ms(dense_bytes, dense_flops)}


# ------------------------------------------------------------------------------------------------
# Weights and programs
# ------------------------------------------------------------------------------------------------
def layer_params(cfg, dtype, layers: int, seed: int):
    """(graphdef, [state per layer]): `layers` independent SparseMoe blocks, every leaf filled on the device by
    verify_scale's per-signature fillers (the layers share shapes: a handful of small compiles)."""
    import jax
    from flax import nnx

    from hyspec_jax.bench import verify_scale as vs
    from hyspec_jax.models.layers import SparseMoe

    abstract = nnx.eval_shape(lambda: SparseMoe(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rules = vs.param_init_rules(abstract)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = []
    for layer in range(layers):
        leaves = []
        for i, (p, v) in enumerate(nnx.to_flat_state(state)):
            a, (kind, scale) = v.get_value(), rules[tuple(p)]
            leaves.append((p, v.replace(value=vs.fill_leaf(kind, scale, a.shape, a.dtype, sharding, seed=seed,
                                                           stream=layer, index=i))))
        out.append(nnx.from_flat_state(leaves))
    return graphdef, out


def stack_fn(graphdef, form: str | None, with_routes: bool = False):
    """(states, x [T, H]) -> x after every layer, x ← x + block_l(x) (and, with_routes, each layer's top_i)."""
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax import moe

    def run(states, x):
        routes = []
        for st in states:
            m = nnx.merge(graphdef, st)
            if with_routes:
                routes.append(moe.route(m.gate(x), m.top_k, m.norm_topk)[1])
            x = x + m(x, form=form)
        return (x, jnp.stack(routes)) if with_routes else x

    return run


def block_fn(graphdef, form: str):
    """(state, x [T, H]) -> one layer's block output alone (no residual), in the given form."""
    from flax import nnx

    return lambda st, x: nnx.merge(graphdef, st)(x, form=form)


def form_table(forms: list[str], tokens: list[int], cfg, itemsize: int, gather_max_gib: float):
    """[(form, T, skip reason or None)] in the order they are timed."""
    out = []
    for T in tokens:
        for f in forms:
            gib = gather_bytes(cfg, T, itemsize) / GIB
            skip = (f"the gathered weights would take {gib:.1f} GiB (> --gather-max-gib {gather_max_gib:g})"
                    if f == "gather" and gib > gather_max_gib else None)
            out.append((f, T, skip))
    return out


def fit_layers(cfg, itemsize: int, reserve_gib: float) -> int:
    """As many layers as the device memory holds, `reserve_gib` left for the largest program's transients."""
    import jax
    from flax import nnx

    from hyspec_jax.models.layers import SparseMoe

    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise UsageError("--layers fit needs a device that reports its memory (memory_stats); give a number")
    abstract = nnx.eval_shape(lambda: SparseMoe(cfg, rngs=nnx.Rngs(0)))
    per_layer = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(abstract))) * itemsize
    n = int((limit - stats.get("bytes_in_use", 0) - reserve_gib * GIB) // per_layer)
    if n < 1:
        raise UsageError(f"not even one layer fits ({per_layer / GIB:.1f} GiB a layer, {limit / GIB:.1f} GiB limit)")
    return n


# ------------------------------------------------------------------------------------------------
# Run
# ------------------------------------------------------------------------------------------------
def sweep(args, cfg, name: str) -> dict:
    import jax
    import jax.numpy as jnp

    from hyspec_jax import moe
    from hyspec_jax.bench.kernels import copy_bandwidth, matmul_peak
    from hyspec_jax.bench.report import portable_args, portable_command, run_metadata

    t_start = time.perf_counter()
    gpu = jax.default_backend() != "cpu"
    dtype = {"auto": jnp.bfloat16 if gpu else jnp.float32, "bfloat16": jnp.bfloat16,
             "float32": jnp.float32}[args.dtype]
    itemsize = jnp.dtype(dtype).itemsize
    layers = fit_layers(cfg, itemsize, args.reserve_gib) if args.layers == "fit" else int(args.layers)
    bandwidth = args.bandwidth * 1e12 if args.bandwidth else copy_bandwidth(2 * GIB if gpu else 64 * 2 ** 20)
    rate = args.matmul_rate * 1e12 if args.matmul_rate else matmul_peak()
    print(f"[moe-scale] {name}, {layers} layers, {jnp.dtype(dtype).name}; bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"matmul {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)

    t0 = time.perf_counter()
    graphdef, states = layer_params(cfg, dtype, layers, args.seed)
    jax.block_until_ready(states)
    init_s = time.perf_counter() - t0
    xs = {T: jax.device_put(jnp.asarray(np.random.default_rng([args.seed, T]).standard_normal((T, cfg.hidden_size)),
                                        dtype)) for T in args.tokens}

    # the routes each layer takes on the chained input (the floors count the distinct experts really chosen)
    routes_fn = jax.jit(stack_fn(graphdef, "dense", with_routes=True))
    distinct = {}
    for T in args.tokens:
        top_i = np.asarray(routes_fn(states, xs[T])[1])                 # [L, T, k]
        distinct[T] = [len(np.unique(r)) for r in top_i]

    plan = form_table(args.forms, args.tokens, cfg, itemsize, args.gather_max_gib)
    jobs = [(f, T) for f, T, skip in plan if skip is None]

    def compile_one(job):
        f, T = job
        t = time.perf_counter()
        lowered = jax.jit(stack_fn(graphdef, f)).lower(states, xs[T])
        lower_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        return compiled, lower_s, time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.compile_workers)) as pool:
        programs = dict(zip(jobs, pool.map(compile_one, jobs)))
    compile_wall_s = time.perf_counter() - t0

    rows = []
    outputs = {}
    slow = {}                                 # form -> (T, seconds) of a call past --max-call-s
    for f, T, skip in plan:
        rule = moe.choose_form(T, cfg.num_experts, cfg.num_experts_per_tok)
        row = {"form": f, "tokens": T, "role": TOKEN_ROLE.get(T, f"{T} rows"), "rule_picks": f == rule,
               **floors(cfg, T, distinct[T], itemsize, bandwidth, rate)}
        if skip:
            rows.append(dict(row, skipped=skip))
            continue
        left = args.max_seconds - (time.perf_counter() - t_start) if args.max_seconds else float("inf")
        if left <= 0:
            rows.append(dict(row, skipped=f"--max-seconds {args.max_seconds:g} passed"))
            continue
        if f in slow and slow[f][1] * T / slow[f][0] > left:     # work grows with T: the call would not end in time
            rows.append(dict(row, skipped=f"--max-seconds {args.max_seconds:g}: one call at T={slow[f][0]} took "
                                          f"{slow[f][1]:.1f} s, ~{slow[f][1] * T / slow[f][0]:.0f} s expected here"))
            continue
        compiled, lower_s, compile_s = programs[(f, T)]
        call = lambda: compiled(states, xs[T])
        t = time.perf_counter()
        out = jax.block_until_ready(call())
        first_s = time.perf_counter() - t
        if first_s > args.max_call_s:        # a call this slow: repeating it would spend the run's time
            slow[f] = (T, first_s)
            times_s, spread, note = [first_s], float("nan"), f"one call only (> --max-call-s {args.max_call_s:g})"
        else:
            timing, out = median_time(call, args.repeats, args.warmup)
            times_s, spread, note = list(timing.times_s), timing.spread, None
        out = np.asarray(out, np.float32)
        outputs[(f, T)] = out
        t_ms = 1e3 * float(np.median(times_s)) / layers
        rows.append(dict(row, t_ms=t_ms, times_ms=[1e3 * t / layers for t in times_s], spread=spread,
                         ratio=t_ms / row["floor_ms"], finite=bool(np.isfinite(out).all()),
                         lower_s=lower_s, compile_s=compile_s, **({"note": note} if note else {})))
        print(f"[moe-scale] {f:>7} T={T:<4} {t_ms:8.3f} ms/layer  floor {row['floor_ms']:.3f}  "
              f"×{t_ms / row['floor_ms']:.2f}", file=sys.stderr)
    # the first layer's block alone on the same input, per timed form (small one-layer programs)
    one = {job: np.asarray(jax.jit(block_fn(graphdef, job[0]))(states[0], xs[job[1]]), np.float32)
           for job in outputs}
    for r in rows:
        job, ref = (r["form"], r["tokens"]), ("dense", r["tokens"])
        if job in outputs and ref in outputs:
            r["block_rel_diff_vs_dense"] = float(np.max(np.abs(one[job] - one[ref])) / np.max(np.abs(one[ref])))
            # the chained residual stream: x + Σ blocks; compare the blocks' sum, not the input it carries
            x0 = np.asarray(xs[r["tokens"]], np.float32)
            dense = outputs[ref]
            r["max_rel_diff_vs_dense"] = float(np.max(np.abs(outputs[job] - dense)) / np.max(np.abs(dense - x0)))
    return {
        "meta": run_metadata(), "command": portable_command("hyspec bench moe-scale", args.argv),
        "argv": portable_args(args.argv),
        "model": {"name": name, "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts,
                  "top_k": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
                  "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                  "norm_topk_prob": cfg.norm_topk_prob, "expert_bytes": expert_bytes(cfg, itemsize),
                  "layer_bytes": cfg.num_experts * expert_bytes(cfg, itemsize) + fixed_bytes(cfg, itemsize)},
        "settings": {"layers": layers, "dtype": jnp.dtype(dtype).name, "tokens": args.tokens, "forms": args.forms,
                     "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
                     "gather_max_gib": args.gather_max_gib},
        "ceilings": {"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": rate,
                     "measured": {"bandwidth": not args.bandwidth, "matmul_rate": not args.matmul_rate}},
        "init_s": init_s, "compile_wall_s": compile_wall_s, "rows": rows,
        "wall_s": time.perf_counter() - t_start,
        "status": "partial" if any("max-seconds" in r.get("skipped", "") for r in rows) else "complete",
    }


def failures(report: dict) -> list[str]:
    bad = []
    for r in report["rows"]:
        if "t_ms" in r and not r["finite"]:
            bad.append(f"{r['form']} T={r['tokens']}: non-finite output")
        if r.get("block_rel_diff_vs_dense", 0.0) > BLOCK_TOL:
            bad.append(f"{r['form']} T={r['tokens']}: one block differs from dense's by "
                       f"{r['block_rel_diff_vs_dense']:.3g} (> {BLOCK_TOL:g})")
    return bad


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def table(report: dict) -> str:
    lines = ["| T (role) | form | ms / layer | floor ms (memory / compute) | × floor | distinct experts | "
             "dense floor ms | vs dense: 1 block / all layers |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        form = r["form"] + (" (rule)" if r["rule_picks"] else "")
        head = f"| {r['tokens']} ({r['role']}) | {form} | "
        floor = f"{r['floor_ms']:.4f} ({r['memory_floor_ms']:.4f} / {r['compute_floor_ms']:.4f})"
        tail = f"{r['distinct_experts_mean']:.1f} | {r['dense_floor_ms']:.4f} | "
        if "skipped" in r:
            lines.append(head + f"skipped: {r['skipped']} | {floor} | | " + tail + " |")
            continue
        diff = (f"{r['block_rel_diff_vs_dense']:.1e} / {r['max_rel_diff_vs_dense']:.1e}"
                if "max_rel_diff_vs_dense" in r else None)
        lines.append(head + f"{r['t_ms']:.4f}" + (f" ({r['note']})" if r.get("note") else "")
                     + f" | {floor} | {r['ratio']:.2f} | " + tail
                     + (f"{diff} |" if diff is not None else " |"))
    return "\n".join(lines)


def markdown(report: dict) -> str:
    meta, s, m, c = report["meta"], report["settings"], report["model"], report["ceilings"]
    return "\n".join([
        f"# Routed MoE per layer: {m['name']}, {meta['device_kind']}", "",
        f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['time_utc']}; "
        f"status **{report['status']}**", "",
        f"Geometry: hidden {m['hidden_size']}, {m['num_experts']} experts, top {m['top_k']}, moe intermediate "
        f"{m['moe_intermediate_size']}, shared expert {m['shared_expert_intermediate_size']}, {s['dtype']} random "
        f"weights ({m['layer_bytes'] / GIB:.2f} GiB a layer, {m['expert_bytes'] / 2 ** 20:.2f} MiB an expert). "
        f"One program of {s['layers']} layers per (form, T), x ← x + block(x); time per layer = median / "
        f"{s['layers']} over {s['repeats']} calls.", "",
        f"Floor: max(bytes / {c['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, FLOPs / "
        f"{c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s) ({'measured in this run' if all(c['measured'].values()) else 'given'}); "
        "bytes = the distinct experts the layer's routes chose + router + shared expert. Dense floor: every "
        "expert. \"vs dense\": max |out − dense| / max |dense block(s)|, for the first layer's block alone on the "
        "same input, then after all layers (there the bf16 rounding of the residual stream, and the top-k choices "
        "it flips, compound in any form). (rule): the form `moe.choose_form` picks.", "",
        table(report), "",
    ])


def write_outputs(report: dict, json_path: str | None) -> None:
    from hyspec_jax.bench.report import write_report
    write_report(report, json_path, markdown)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _forms(s: str) -> list[str]:
    from hyspec_jax.moe import FORMS

    out = [f.strip() for f in s.split(",") if f.strip()]
    bad = [f for f in out if f not in FORMS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"forms must be among {', '.join(FORMS)}, got {s!r}")
    return out


def _layers(s: str) -> str:
    if s == "fit" or (s.isdigit() and int(s) >= 1):
        return s
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'fit', got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench moe-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run, tests)")
    ap.add_argument("--tokens", type=_ints, default=list(DEFAULT_TOKENS), metavar="T,..",
                    help="rows per call (default 1,8,32,256)")
    ap.add_argument("--forms", type=_forms, default=["gather", "dense"], metavar="F,..",
                    help="execution forms (default gather,dense)")
    ap.add_argument("--layers", type=_layers, default="8", metavar="L|fit",
                    help="distinct layers per program (default 8; 'fit': as many as the device memory holds)")
    ap.add_argument("--reserve-gib", type=float, default=8.0, metavar="G",
                    help="with --layers fit: memory left for transients (default 8)")
    ap.add_argument("--gather-max-gib", type=float, default=8.0, metavar="G",
                    help="skip the gather form where its weight copy per layer exceeds G GiB (default 8)")
    ap.add_argument("--repeats", type=int, default=20, metavar="K", help="timed calls per program (default 20)")
    ap.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed calls first (default 2)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="weights / activations (auto: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--bandwidth", type=float, metavar="TB/s", help="HBM bandwidth for the floors (default: measured)")
    ap.add_argument("--matmul-rate", type=float, metavar="TFLOP/s",
                    help="matmul rate for the floors (default: measured)")
    ap.add_argument("--max-call-s", type=float, default=1.0, metavar="S",
                    help="a program whose first call takes longer is timed by that one call (default 1)")
    ap.add_argument("--max-seconds", type=float, metavar="S",
                    help="time no further program once S seconds have passed since the start (status partial)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), metavar="W",
                    help="parallel XLA compiles (default min(8, cores/2))")
    ap.add_argument("--json", metavar="OUT.json", help="write OUT.json and OUT.md")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if args.repeats < 1 or args.warmup < 1:
        ap.error("--repeats and --warmup must be ≥ 1")
    for name in ("bandwidth", "matmul_rate", "max_call_s", "max_seconds"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    cfg, name = (tiny_config(), "tiny geometry") if args.tiny else (qwen3_next_80b_a3b(), "Qwen3-Next-80B-A3B geometry")
    try:
        report = sweep(args, cfg, name)
    except UsageError as e:
        ap.error(str(e))
    write_outputs(report, args.json)
    print(f"\n{markdown(report)}")
    bad = failures(report)
    for b in bad:
        print(f"[moe-scale] ERROR: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
