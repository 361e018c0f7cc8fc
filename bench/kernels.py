"""Benchmark of the GDN tree-verification kernels against their baselines.

    hyspec bench kernels --json out.json [--configs 1:64,32:64] [--variants REGEX] [--deferred 8] [--attention ..]

For the Qwen3.8-27B GDN geometry (HK 16, HV 48, dk = dv = 128; fp32 state) at batch
1/8/32 and tree sizes N = 16/32/64 (4/6/8 nodes on the longest path), with the inputs the bf16 model's verify
hands the kernel (`make_set`: `target.verify_solve_call` through `kernels.kernel_operands`: a bf16 model's fp32 q/k/v, q/k at
their 16 key heads; tests/test_verify_inputs.py keeps the two equal), it checks every variant against the fp32
reference (gdn.masked_solve, triangular solve, precision HIGHEST) on random trees and times:
  pallas_{neumann,squaring}_bv{16..128}[_nwW]  our value-tiled closed-form kernel (tf32 tensor cores)
  pallas_inverse_bv*                       the same with (I+L)⁻¹ and C(I+L)⁻¹ built before the state tile
  pallas_split_bv*[_owW]                   those node-wise operators in a first launch, the value tiles in a second
  pallas_split_mgpu_bv*[_ow8|_chpair]      the split form with its Mosaic GPU value pass (64 nodes, Hopper)
  pallas_*_tf32x3                          the same with 3-pass tf32 (≈ fp32 accuracy)
  null_overhead                            a trivial op on the same inputs: the harness per-call cost
  serial_pallas_bv{32,64}                  SGLang-style per-node serial kernel (parent state from HBM)
  xla_solve / xla_neumann                  gdn.masked_solve jitted (XLA)
  xla_scan_paths                           lax.scan serial recurrence per root-to-leaf path (XLA)
and the cross-layer commit (48 GDN layers) against its XLA reference. With `--attention B:N:S,..` also the
verify's tree attention of one full-attention layer (24 query heads, 4 KV heads, head_dim 256, bf16; committed
prefix of S tokens + N tree nodes): the concatenate-then-attend form the verify runs and the two-part form
`attention.attend_prefix_tree`, each against the memory floor (the bar: XLA within 1.2x of it, else a kernel).
With `--deferred B,..` the deferred commit (`gdn.DeferredUpdates`): the one-launch append of the accepted paths
over all GDN layers against the eager path commit, and the tree solve merging P update rows on chip (with and
without writing the merged state back), summed per round and layer with a merge every P / depth rounds.
`--merge A.json B.json --json OUT.json` re-renders runs as one; every run writes OUT.md and OUT.png beside OUT.json.

Timing: each variant is jitted over R distinct input sets (rotating buffers, so repeated
calls do not hit a cache and cannot be merged), warmed up, then timed `reps` times with
block_until_ready; per-call time = median / R. device_us (GPU, unless --no-profile): the time the GPU spends in
the call's kernels, summed from a `jax.profiler` trace of 3 more runs (no dispatch, no idle gaps). Commit: S is donated and fed back (in place), K calls per
timed block. Writes JSON with device kind, jax version, git commit, medians and errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp

from hyspec_jax import gdn, kernels
from hyspec_jax.bench.report import (busy_time_ns, git_commit, gpu_stream_events, portable_command, profile_trace,
                                     run_metadata, save_png)
from hyspec_jax.models.target import verify_solve_call
from hyspec_jax.spec.memory import qwen38_27b
from hyspec_jax.pallas_kernels import gdn_tree_split_mgpu, trees
from hyspec_jax.pallas_kernels.gdn_commit import (deferred_append_pallas, deferred_append_reference, deferred_to_reference,
                                       path_commit_pallas, path_commit_reference)
from hyspec_jax.pallas_kernels.gdn_serial import masked_solve_xla, serial_paths_xla, serial_tree_pallas
from hyspec_jax.pallas_kernels.gdn_tree_solve import SolveConfig, tree_solve_pallas

GEOMETRY = qwen38_27b()
HK, HV = GEOMETRY.linear_num_key_heads, GEOMETRY.linear_num_value_heads
DK, DV, LG = GEOMETRY.linear_key_head_dim, GEOMETRY.linear_value_head_dim, len(GEOMETRY.gdn_layers)
DEPTH_FOR_N = {16: 4, 32: 6, 64: 8, 128: 8}   # nodes on the longest path (the kernels' path_nodes; depth + 1)
# default sweep: the block_v grid at default warps, the 3-pass precision, baselines, overhead probe
DEFAULT_VARIANTS = (r"pallas_(neumann|squaring|inverse|split)_bv(32|64|128)|pallas_.*tf32x3|serial_pallas_.*|xla_.*|null_overhead"
                    r"|pallas_commit_.*")


def solve(*args, path_nodes: int, interpret: bool = False, write_state: bool = False, **config):
    """`tree_solve_pallas` with its `SolveConfig`'s fields as keywords."""
    return tree_solve_pallas(*args, path_nodes=path_nodes, config=SolveConfig(**config), write_state=write_state,
                             interpret=interpret)


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _maxabs(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def make_set(seed: int, B: int, N: int, dtype=jnp.bfloat16):
    """One input set (S0, q, k, v, g, β) as the verify of a model computing in `dtype` hands it to the kernel:
    `verify_solve_call`'s mixer inputs, q/k/v as `kernels.kernel_operands` gives them; S0 the layer's own state (the
    verify hands the one-launch kernels the whole stack and the layer's index — `hyspec bench gdn-layer` times that;
    the kernel forms compared here read the same tiles)."""
    depth = DEPTH_FOR_N.get(N, min(8, N)) - 1
    geometry = dataclasses.replace(GEOMETRY, linear_num_key_heads=HK, linear_num_value_heads=HV,   # the constants:
                                   linear_key_head_dim=DK, linear_value_head_dim=DV)               # tests shrink them
    call = verify_solve_call(geometry, B, N, depth=depth, dtype=dtype, seed=seed)
    q, k, v, _ = kernels.kernel_operands(call.q, call.k, call.v, dtype)
    return call.S0[call.layer], q, k, v, call.g, call.beta


def value_pass_inputs(seed: int, B: int, N: int = 64, depth: int = 8, interpret: bool = False) -> tuple:
    """The Mosaic GPU value pass's arguments (gdn_tree_split_mgpu.tree_apply_mgpu: Γ, β head-major, the [M; C M]
    bf16 pair, k, q, v, S0) for one input set of the bench geometry, from the Triton operator pass as split_mgpu
    runs it (fp16 chain, int8 mask): what the value-pass probes in bench/recipes time on their own. depth: nodes
    on the longest path, as DEPTH_FOR_N."""
    from hyspec_jax.pallas_kernels import gdn_tree_solve

    mask = trees.mask_from_parents(jnp.asarray(trees.random_parents(1000 * B + N, B, N, depth - 1)))
    S0, q, k, v, g, beta = make_set(seed, B, N)
    gamma, mc_hi, mc_lo, beta_hn = gdn_tree_solve._tree_operators_triton(
        q, k, g, beta, mask, rounds=gdn_tree_solve.num_rounds(depth, N),
        precision=gdn_tree_solve._f32_precision("tf32", interpret), form="pair", operator_warps=4,
        interpret=interpret, chain="f16", mask_dtype=jnp.int8)
    return gamma, beta_hn, mc_hi, mc_lo, k, q, v, S0


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device streaming rate in bytes/s (x ← x + 1 in place, counting read + write)."""
    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    x = f(jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32))
    x.block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(5):
            x = f(x)
        x.block_until_ready()
        ts.append((time.perf_counter() - t) / 5)
    return 2 * nbytes / float(np.median(ts))


def matmul_peak(n: int | None = None) -> float:
    """Dense bf16 matmul rate in FLOP/s (n × n × n, fp32 accumulation, median of 10): the compute ceiling a
    compute-bound kernel is held to, as `copy_bandwidth` is the memory ceiling."""
    n = n or (8192 if jax.default_backend() == "gpu" else 512)
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(5):
            out = f(a, b)
        out.block_until_ready()
        ts.append((time.perf_counter() - t) / 5)
    return 2 * n ** 3 / float(np.median(ts))


def device_kernel_time(run, calls: int) -> dict:
    """Device time per call from JAX's profiler trace: run() (one executable of `calls` calls, blocking) goes
    PROFILE_REPS times under `jax.profiler.trace`; the GPU planes' stream events (kernels, memsets, copies the
    executable itself issues) are summed per call. Unlike a host clock this leaves out dispatching and awaiting the
    executable and the idle gaps between launches: it is the time the GPU spends in our kernels, warm (the
    Nsight Compute tables in bench/results/kernels/kernel_resources_*.md time one cold, serialized launch)."""
    def reps():
        for _ in range(PROFILE_REPS):
            run()
    return gpu_stream_time(profile_trace(reps), PROFILE_REPS * calls)


def gpu_stream_time(data, calls: int) -> dict:
    """Sum of the GPU stream events of a profile (`jax.profiler.ProfileData`) per call, the time the GPU is busy
    with them (device_busy_us: below the sum only where launches overlap), and the largest kernels."""
    per_name: dict[str, float] = {}
    events = gpu_stream_events(data)
    for _, duration, name in events:
        per_name[name] = per_name.get(name, 0.0) + duration
    if not per_name:
        gpu_lines = [line.name for p in data.planes if p.name.startswith("/device:GPU") for line in p.lines]
        raise RuntimeError(f"no GPU stream events in the trace (planes {[p.name for p in data.planes]}, "
                           f"GPU lines {gpu_lines[:12]})")
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    return {"device_us": sum(per_name.values()) / 1e3 / calls, "device_busy_us": busy_time_ns(events) / 1e3 / calls,
            "device_kernels_us": {k: v / 1e3 / calls for k, v in top}}


PROFILE_REPS = 3


def _timed_runs(run, R: int, reps: int, warmup: int, profile: bool) -> dict:
    """run() (one executable over R sets, blocking) after `warmup` − 1 more untimed runs (the first, which
    compiled, is the caller's): per-set median / min / spread of `reps` runs, and with profile (GPU) the device time
    per set from a profiler trace (`device_kernel_time`)."""
    for _ in range(warmup - 1):
        run()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    rec = {"median_us": 1e6 * float(np.median(ts)) / R, "min_us": 1e6 * float(np.min(ts)) / R,
           "spread_us": 1e6 * float(np.percentile(ts, 90) - np.percentile(ts, 10)) / R, "sets": R, "reps": reps}
    if profile and jax.default_backend() == "gpu":
        try:
            rec.update(device_kernel_time(run, R))
        except Exception as e:  # noqa: BLE001 — the host-clock time stands without it
            rec["device_error"] = f"{type(e).__name__}: {e}"[:500]
    return rec


def _transient_bytes(fn, *args, **jit_kw) -> dict:
    """XLA's scratch for one call of jit(fn)(*args): intermediates between its kernels, never the outputs ({} on a
    backend without memory analysis: the timing stands without it)."""
    try:
        return {"transient_bytes": int(jax.jit(fn, **jit_kw).lower(*args).compile().memory_analysis()
                                       .temp_size_in_bytes)}
    except Exception:  # noqa: BLE001
        return {}


def time_multi(fn, sets, reps: int, warmup: int = 2, check=None, profile: bool = False, indexed: bool = False) -> dict:
    """Median seconds per call of fn over rotating input sets (one jitted executable runs them all); indexed: fn
    takes the set's index first (a static int: e.g. the layer a set is of a shared state stack).

    check(first_output) -> dict of errors is called on the first run's output for sets[0]. profile (GPU): also
    the device time per call from a profiler trace (`device_kernel_time`)."""
    transient = _transient_bytes(functools.partial(fn, 0) if indexed else fn, *sets[0])
    multi = jax.jit(lambda ss: [fn(i, *s) if indexed else fn(*s) for i, s in enumerate(ss)])
    run = lambda: jax.block_until_ready(multi(sets))    # noqa: E731
    t0 = time.perf_counter()
    res = run()
    compile_s = time.perf_counter() - t0
    errs = check(res[0]) if check is not None else {}
    del res
    return {**errs, **transient, **_timed_runs(run, len(sets), reps, warmup, profile), "compile_s": compile_s}


def chain_steps(fn, state, sets):
    """fn(i, state, *sets[i]) -> (out, state) over the sets in order, each step handed the state the one before
    returned: (final state, outs)."""
    outs = []
    for i, s in enumerate(sets):
        out, state = fn(i, state, *s)
        outs.append(out)
    return state, outs


def time_chained(fn, sets, state, reps: int, warmup: int = 2, check=None, profile: bool = False) -> dict:
    """`time_multi` for a step that updates one buffer in place, as a model's layers pass on the stack they update:
    `chain_steps(fn, state, sets)` in one executable that takes `state` donated and hands the updated one back (so
    no copy of it is timed). check(out of set 0, state after the first run) -> dict of errors. Consumes `state`."""
    chain = functools.partial(chain_steps, fn)
    transient = _transient_bytes(chain, state, sets, donate_argnums=0)
    multi = jax.jit(chain, donate_argnums=0)
    box = [state]

    def run():
        box[0], outs = multi(box[0], sets)
        return jax.block_until_ready((box[0], outs))

    t0 = time.perf_counter()
    st, outs = run()
    compile_s = time.perf_counter() - t0
    errs = check(outs[0], st) if check is not None else {}
    del st, outs
    return {**errs, **transient, **_timed_runs(run, len(sets), reps, warmup, profile), "compile_s": compile_s}


def _measure(fn, sets, reps: int, check, floor_us: float, profile: bool = False) -> dict:
    """time_multi of one variant, with its distance to the floor; an exception is recorded, not raised."""
    rec = {}
    try:
        rec.update(time_multi(fn, sets, reps, check=check, profile=profile))
        rec["pct_of_floor"] = 100.0 * floor_us / rec["median_us"]
        rec["x_floor"] = rec["median_us"] / floor_us
        if "device_us" in rec:
            rec["device_x_floor"] = rec["device_us"] / floor_us
    except Exception as e:  # noqa: BLE001 — record and go on
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
    return rec


def solve_bytes(B, N) -> int:
    """Fewest bytes a tree solve must move: S0, q, k (key heads), v, g, β, mask in; o, V', Γ out."""
    return (B * HV * DK * DV * 4 + 2 * B * N * HK * DK * 2 + B * N * HV * DV * 2 + 2 * B * N * HV * 4
            + B * N * N * 4 + 2 * B * N * HV * DV * 4 + B * HV * N * 4)


def bench_tree(B: int, N: int, args, bw: float, log, depth: int | None = None) -> dict:
    """One tree-solve configuration: B random trees of N nodes, depth (nodes on the longest path) DEPTH_FOR_N[N]
    unless given; depth = N is a chain."""
    depth = DEPTH_FOR_N[N] if depth is None else min(depth, N)     # the depth the trees really have
    parents_np = trees.random_parents(1000 * B + N, B, N, depth - 1)
    parents = jnp.asarray(parents_np)
    mask = trees.mask_from_parents(parents)
    path_nodes = jnp.asarray(trees.leaf_paths(parents_np, depth - 1)[0])
    big = B * N >= 1024
    R = 4 if big else 8
    sets = [make_set(7919 * i + B * N, B, N) for i in range(R)]
    o_ref, fac_ref = masked_solve_xla(*sets[0], mask, method="solve")
    o_ref, vc_ref = jax.block_until_ready((o_ref, fac_ref.corrected))

    interpret = bool(getattr(args, "interpret", False))          # Pallas interpret mode: the CPU test
    variants = {}
    for method in ["neumann", "squaring", "inverse", "split"]:
        for bv in [16, 32, 64, 128]:
            for nw in [None, 2, 8]:
                name = f"pallas_{method}_bv{bv}" + ("" if nw is None else f"_nw{nw}")
                variants[name] = (
                    lambda *s, m=method, bv=bv, nw=nw: solve(
                        *s, mask, path_nodes=depth, method=m, block_v=bv, precision="tf32", num_warps=nw,
                        interpret=interpret), "solve")
    for bv in [32, 64, 128]:            # the split form's operator pass at 2 / 8 warps (4 above)
        for nw in [None, 2, 8]:
            for ow in [2, 8]:
                name = f"pallas_split_bv{bv}" + ("" if nw is None else f"_nw{nw}") + f"_ow{ow}"
                variants[name] = (
                    lambda *s, bv=bv, nw=nw, ow=ow: solve(
                        *s, mask, path_nodes=depth, method="split", block_v=bv, precision="tf32", num_warps=nw,
                        operator_warps=ow, interpret=interpret), "solve")
    if gdn_tree_split_mgpu.supported(N, DK, DV, 64, jnp.bfloat16):   # the Mosaic GPU value pass (64 nodes)
        # split_mgpu: the Triton operator pass (fp16 chain) + the Mosaic GPU value pass; _ow8: that operator pass at
        # 8 warps (4 otherwise); bv16 / bv32: narrower value tiles (more, smaller value programs; k, q and [M; C M]
        # are read once per tile); _chpair: the operator pass forms M and C M by bf16-pair products (operator_chain)
        for name, bv, ow, chain in [("pallas_split_mgpu_bv64", 64, 4, None),
                                    ("pallas_split_mgpu_bv64_ow8", 64, 8, None),
                                    ("pallas_split_mgpu_bv16", 16, 4, None), ("pallas_split_mgpu_bv32", 32, 4, None),
                                    ("pallas_split_mgpu_bv64_chpair", 64, 4, "pair")]:
            variants[name] = (
                lambda *s, bv=bv, ow=ow, chain=chain: solve(
                    *s, mask, path_nodes=depth, method="split_mgpu", block_v=bv, precision="tf32", operator_warps=ow,
                    operator_chain=chain, interpret=interpret), "solve")
    variants["pallas_neumann_bv64_tf32x3"] = (
        lambda *s: solve(*s, mask, path_nodes=depth, method="neumann", block_v=64, precision="tf32x3",
                         interpret=interpret), "solve")
    variants["pallas_squaring_bv32_tf32x3"] = (
        lambda *s: solve(*s, mask, path_nodes=depth, method="squaring", block_v=32, precision="tf32x3",
                         interpret=interpret), "solve")
    for bv in [32, 64]:
        variants[f"serial_pallas_bv{bv}"] = (
            # o only: the per-node states are then scratch of the call, and count as its transient memory
            lambda *s, bv=bv: serial_tree_pallas(*s, parents, block_v=bv, interpret=interpret)[0], "serial")
    variants["xla_solve"] = (lambda *s: masked_solve_xla(*s, mask, method="solve"), "xla")
    variants["xla_neumann"] = (lambda *s: masked_solve_xla(*s, mask, method="neumann", path_nodes=depth), "xla")
    variants["xla_scan_paths"] = (lambda *s: serial_paths_xla(*s, path_nodes), "paths")
    # harness overhead probe: a trivial op on the same inputs (per-call dispatch cost inside the timing)
    variants["null_overhead"] = (lambda *s: s[0][0, 0, 0, :8] + 1.0, "null")
    variants = {n: x for n, x in variants.items() if re.fullmatch(args.variants, n)}

    floor_us = 1e6 * solve_bytes(B, N) / bw
    out = {"B": B, "N": N, "depth": depth, "paths": int(path_nodes.shape[1]), "floor_us": floor_us,
           "variants": {}}
    def checker(kind):
        def check(res):
            if kind == "solve":
                o, gamma, vc = res
                return dict(err_o=_rel(o, o_ref), err_vc=_rel(vc, vc_ref), maxabs_o=_maxabs(o, o_ref),
                            err_gamma=_rel(gamma, fac_ref.log_decay))
            if kind == "xla":
                o, fac = res
                return dict(err_o=_rel(o, o_ref), err_vc=_rel(fac.corrected, vc_ref), maxabs_o=_maxabs(o, o_ref))
            if kind == "serial":
                return dict(err_o=_rel(res, o_ref), maxabs_o=_maxabs(res, o_ref))
            if kind == "paths":
                return dict(err_o=_rel(res, o_ref), maxabs_o=_maxabs(res, o_ref))
            return {}
        return check

    for name, (fn, kind) in variants.items():
        use = sets if not (kind == "serial" and big) else sets[:2]     # per-node states are large
        out["variants"][name] = rec = _measure(fn, use, args.reps, checker(kind), floor_us,
                                               getattr(args, "profile", False))
        log(f"  B={B:<3d} N={N:<3d} {name:<28s} " + (
            f"{rec['median_us']:10.1f} us  device {rec.get('device_us', float('nan')):8.1f} us  "
            f"err_o {rec.get('err_o', float('nan')):.2e}"
            if "median_us" in rec else f"ERROR {rec.get('error', '')[:200]}"))
    return out


def time_in_place(f, donated: tuple, rest: tuple, reps: int, check, floor_us: float, K: int = 5,
                  profile: bool = False) -> dict:
    """Per-call time of f(*donated, *rest) -> (*donated', ...) with the donated buffers fed back (in-place
    updates, as the engine runs them): K calls chained inside one executable (unrolled, so the time is the
    device's and not one host dispatch per call); check(first outputs) -> errors. An exception is recorded,
    not raised."""
    rec = {}
    try:
        n = len(donated)
        fj = jax.jit(f, donate_argnums=tuple(range(n)))

        def chained(*args):
            state = tuple(args[:n])
            for _ in range(K):
                state = tuple(f(*state, *args[n:])[:n])
            return state
        fk = jax.jit(chained, donate_argnums=tuple(range(n)))
        t0 = time.perf_counter()
        res = jax.block_until_ready(fj(*donated, *rest))
        rec["compile_s"] = time.perf_counter() - t0
        rec.update(check(res))
        state = tuple(res[:n])
        del res
        state = jax.block_until_ready(fk(*state, *rest))             # compile the chained executable
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            state = jax.block_until_ready(fk(*state, *rest))
            ts.append((time.perf_counter() - t) / K)
        rec.update(median_us=1e6 * float(np.median(ts)), min_us=1e6 * float(np.min(ts)),
                   spread_us=1e6 * float(np.percentile(ts, 90) - np.percentile(ts, 10)), calls_per_block=K,
                   timing="K calls chained in one executable")
        if profile and jax.default_backend() == "gpu":   # GPU time per call from a profiler trace, as time_multi
            box = {"s": state}

            def run():
                box["s"] = jax.block_until_ready(fk(*box["s"], *rest))
            try:
                rec.update(device_kernel_time(run, K))
            except Exception as e:  # noqa: BLE001
                rec["device_error"] = f"{type(e).__name__}: {e}"[:500]
            state = box["s"]
        rec.update(floor_us=floor_us, pct_of_floor=100.0 * floor_us / rec["median_us"])
        del state
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
    return rec


def bench_commit(B: int, N: int, args, bw: float, log) -> dict:
    depth = DEPTH_FOR_N[N]
    parents_np = trees.random_parents(77 + B, B, N, depth - 1)
    mask = trees.mask_from_parents(jnp.asarray(parents_np))
    rng = np.random.default_rng(B)
    node = rng.integers(0, N, size=B).astype(np.int32)
    if B > 1:
        node[1] = -1                                              # one request accepted nothing
    node = jnp.asarray(node)
    ks = jax.random.split(jax.random.key(B + 5), 4)
    Lg = args.layers
    S0 = jax.random.normal(ks[0], (Lg, B, HV, DK, DV), jnp.float32) * 0.1
    gam = jnp.cumsum(-jax.random.uniform(ks[1], (Lg, B, HV, N)) * 0.1, -1)
    keys = gdn.l2norm(jax.random.normal(ks[2], (Lg, B, N, HK, DK))).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[3], (Lg, B, HV, N, DV), jnp.float32) * 0.1
    ref = jax.block_until_ready(jax.jit(path_commit_reference)(S0, gam, keys, vc, mask, node))
    n_acc = int(jnp.sum(node >= 0))
    bytes_ = n_acc * Lg * HV * DK * DV * 4 * 2 + Lg * B * HV * N * (DV * 4 + 4) + Lg * B * N * HK * DK * 2
    out = {"B": B, "N": N, "layers": Lg, "accepted_requests": n_acc, "floor_us": 1e6 * bytes_ / bw,
           "variants": {}}
    variants = {}
    for bv in [32, 64, 128]:
        for prec in ["tf32x3", "tf32"]:
            variants[f"pallas_commit_bv{bv}_{prec}"] = (
                lambda S, *a, bv=bv, p=prec: path_commit_pallas(S, *a, block_v=bv, precision=p))
    variants["xla_reference"] = path_commit_reference
    variants = {n: x for n, x in variants.items() if re.fullmatch(args.variants, n)}
    for name, fn in variants.items():
        out["variants"][name] = rec = time_in_place(
            lambda S, *rest, fn=fn: (fn(S, *rest),), (jnp.copy(S0),), (gam, keys, vc, mask, node), args.reps,
            lambda res: dict(err=_rel(res[0], ref), maxabs=_maxabs(res[0], ref)), out["floor_us"],
            profile=getattr(args, "profile", False))
        log(f"  commit B={B:<3d} N={N:<3d} {name:<26s} " + (
            f"{rec['median_us']:10.1f} us  err {rec.get('err', float('nan')):.2e}"
            if "median_us" in rec else f"ERROR {rec.get('error', '')[:200]}"))
    return out


def bench_deferred(B: int, N: int, args, bw: float, log) -> dict:
    """Deferred commit (`gdn.DeferredUpdates`) against the eager one, at the 27B GDN geometry.

    commit: `deferred_append_pallas` (every request accepts a full-depth path — the most rows — over all GDN
    layers, one launch) against `path_commit_pallas` (rewrites each accepted request's state in every layer).
    verify, one layer: the tree solve without updates, with P rows of updates merged on chip (every row in
    use), and the same writing the merged state back (S donated, in place). Per round and layer, with a merge
    every R = P // depth rounds: eager = solve + commit / layers; deferred = ((R−1)·solve_deferred +
    solve_merge) / R + append / layers."""
    depth, Lg = DEPTH_FOR_N[N], args.layers
    parents_np = trees.random_parents(91 + B, B, N, depth - 1)
    mask = trees.mask_from_parents(jnp.asarray(parents_np))
    nodes_at_depth = np.asarray(trees.depth_of(mask)) == depth - 1
    node = jnp.asarray(np.argmax(nodes_at_depth, axis=1).astype(np.int32))       # a deepest node per request
    path, length = map(jnp.asarray, trees.paths_to(parents_np, np.asarray(node), depth - 1))
    ks = jax.random.split(jax.random.key(B + 11), 6)
    gam = jnp.einsum("lbhj,bij->lbhi", -jax.random.uniform(ks[0], (Lg, B, HV, N)) * 0.2, mask.astype(jnp.float32))
    keys = gdn.l2norm(jax.random.normal(ks[1], (Lg, B, N, HK, DK))).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[2], (Lg, B, HV, N, DV), jnp.float32) * 0.1
    method, bv = args.deferred_method, args.deferred_block_v
    interpret = bool(getattr(args, "interpret", False))          # Pallas interpret mode: the CPU test
    out = {"B": B, "N": N, "depth": depth, "layers": Lg, "method": method, "block_v": bv, "variants": {}}
    rows_written = int(jnp.sum(length))
    # eager commit of the same accepted nodes (S donated, in place)
    S0l = jax.random.normal(ks[3], (Lg, B, HV, DK, DV), jnp.float32) * 0.1
    eager_bytes = B * Lg * HV * DK * DV * 4 * 2 + Lg * B * HV * N * (DV * 4 + 4) + Lg * B * N * HK * DK * 2
    out["variants"]["commit_eager"] = rec = time_in_place(
        lambda S, *r: (path_commit_pallas(S, *r, block_v=min(64, DV), precision="tf32", interpret=interpret),), (S0l,), (gam, keys, vc, mask, node),
        args.reps, lambda res: {}, 1e6 * eager_bytes / bw, profile=getattr(args, "profile", False))
    del S0l
    log(f"  deferred B={B:<3d} N={N:<3d} commit_eager ({Lg} layers) " + _us(rec))
    sets = [make_set(4099 * i + B * N, B, N) for i in range(4)]
    for P in map(int, args.deferred_rows.split(",")):
        # updates in kernel layout, every row in use for the solve; count = P − depth before the append
        kd = jax.random.split(jax.random.key(P + B), 4)
        def updates(L, count):
            c = -jax.random.uniform(kd[0], (L, B, HV)) * 2.0
            return (c, c[..., None] + jax.random.uniform(kd[1], (L, B, HV, P)),
                    gdn.l2norm(jax.random.normal(kd[2], (L, B, P, HK, DK))).astype(jnp.bfloat16),
                    jax.random.normal(kd[3], (L, B, HV, P, DV), jnp.float32) * 0.1, jnp.full((B,), count, jnp.int32))
        upd = updates(Lg, P - depth)
        ref = jax.jit(deferred_append_reference)(upd, gam, keys, vc, path, length)
        bytes_ = 2 * rows_written * Lg * (HV * (DV * 4 + 4) + HK * DK * 2)          # rows read + written
        def check_append(res, ref=ref):
            return {"err": max(_rel(a, b) for a, b in zip(res[:4], ref[:4])),
                    "count_ok": bool(jnp.all(res[4] == ref[4]))}
        for lb in (1, 4):                 # layers per program: 1, or 4 layers' rows in one gather / scatter
            if Lg % lb:
                continue
            name = f"append_P{P}" + ("" if lb == 1 else f"_l{lb}")
            out["variants"][name] = rec = time_in_place(
                lambda c, rc, pk, pv, *r, lb=lb: deferred_append_pallas(
                    (c, rc, pk, pv, r[0]), *r[1:], layers_per_program=lb, interpret=interpret),
                tuple(jnp.copy(x) for x in upd[:4]),           # donated: each variant gets its own copies
                (upd[4], gam, keys, vc, path, length), args.reps, check_append, 1e6 * bytes_ / bw,
                profile=getattr(args, "profile", False))
            log(f"  deferred B={B:<3d} N={N:<3d} {name} ({Lg} layers) " + _us(rec))
        del upd, ref
        one = tuple(x[0] for x in updates(1, P)[:4]) + (jnp.full((B,), P, jnp.int32),)
        S_eff = gdn.deferred_fold(sets[0][0], jax.tree.map(lambda x: x[0], deferred_to_reference(
            tuple(x[None] for x in one[:4]) + (one[4],), HV)))
        o_ref = masked_solve_xla(S_eff, *sets[0][1:], mask, method="solve")[0]
        kw = dict(path_nodes=depth, method=method, block_v=bv, precision="tf32", interpret=interpret)
        rows_bytes = B * HV * P * (DV * 4 + 4) + B * P * HK * DK * 2                  # the P update rows read
        for name, fn, kind in (("solve_plain", lambda *s: solve(*s, mask, **kw), "plain"),
                               (f"solve_deferred_P{P}", lambda *s: solve(*s, mask, one, **kw), "deferred")):
            if name in out["variants"]:
                continue
            chk = (lambda res: {"err_o": _rel(res[0], o_ref)}) if kind == "deferred" else (lambda res: {})
            floor = 1e6 * (solve_bytes(B, N) + (rows_bytes if kind == "deferred" else 0)) / bw
            out["variants"][name] = rec = _measure(fn, sets, args.reps, chk, floor, getattr(args, "profile", False))
            log(f"  deferred B={B:<3d} N={N:<3d} {name} " + _us(rec))
        out["variants"][f"solve_merge_P{P}"] = rec = time_in_place(
            lambda S, *r: solve(S, *r[:5], mask, one, write_state=True, **kw)[3:],
            (jnp.copy(sets[0][0]),), sets[0][1:], args.reps, lambda res: {"err_state": _rel(res[0], S_eff)},
            1e6 * (solve_bytes(B, N) + B * HV * DK * DV * 4) / bw, profile=getattr(args, "profile", False))
        log(f"  deferred B={B:<3d} N={N:<3d} solve_merge_P{P} " + _us(rec))
        t = lambda n: out["variants"].get(n, {}).get("median_us", float("nan"))  # noqa: E731
        R = max(1, P // depth)
        eager = t("solve_plain") + t("commit_eager") / Lg
        deferred = ((R - 1) * t(f"solve_deferred_P{P}") + t(f"solve_merge_P{P}")) / R + t(f"append_P{P}") / Lg
        out.setdefault("per_round_layer_us", {})[f"P{P}"] = {"merge_every": R, "eager": eager, "deferred": deferred}
        log(f"  deferred B={B:<3d} N={N:<3d} P={P}: per round and layer {eager:.1f} us eager, {deferred:.1f} us "
            f"deferred (merge every {R} rounds)")
    return out


def _us(rec: dict) -> str:
    if "median_us" not in rec:
        return f"ERROR {rec.get('error', '')[:200]}"
    errs = "  ".join(f"{k} {v:.1e}" for k, v in rec.items() if k.startswith("err") and isinstance(v, float))
    dev = f"  (GPU {rec['device_us']:.1f} us)" if "device_us" in rec else ""
    return f"{rec['median_us']:10.1f} us{dev}  {errs}"


ATTN_GEOMETRY = (24, 4, 256)      # Qwen3.8-27B full attention: query heads, KV heads, head_dim
# Pallas tree attention tilings: (query rows, keys) per block, warps, pipeline stages
ATTN_TILINGS = ((64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2),
                (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3))


def parse_configs(text: str) -> list[tuple[int, int, int | None]]:
    """'B:N[:D],..' -> [(batch, nodes, depth or None)]; depth counts nodes on the longest path (D = N: a chain)."""
    out = []
    for item in text.split(","):
        try:
            parts = [int(x) for x in item.split(":")]
        except ValueError:
            parts = []
        if not 2 <= len(parts) <= 3 or min(parts) < 1 or parts[1] not in DEPTH_FOR_N:
            raise argparse.ArgumentTypeError(f"config {item!r}: expected B:N[:D] with N in {sorted(DEPTH_FOR_N)}")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else None))
    return out


def parse_tilings(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """'R:S[:W[:G]],..' -> ((rows, keys, warps, stages), ..): warps default 4, stages 2."""
    out = []
    for item in text.split(","):
        parts = [int(x) for x in item.split(":")]
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"tiling {item!r}: expected ROWS:KEYS[:WARPS[:STAGES]]")
        out.append(tuple(parts + [4, 2][len(parts) - 2:]))
    return tuple(out)


def attention_flops(B: int, N: int, S: int, geometry=ATTN_GEOMETRY) -> int:
    """Matmul FLOPs of a verify's tree attention: every query row (N nodes × query heads) against S + N keys,
    scores and the weighted sum of values (2 FLOPs a multiply-add each). With N = 64 nodes × 6 query heads
    sharing a KV head, each K/V element read serves 384 rows: above the H200's ridge point (≈ 190 FLOP/B), so
    these shapes are bound by the tensor cores, not by HBM."""
    nh, _, hd = geometry
    return 4 * B * nh * N * (S + N) * hd


def attention_bytes(B: int, N: int, S: int, geometry=ATTN_GEOMETRY) -> int:
    """Fewest bytes a verify's tree attention must move (bf16): the committed K and V of S tokens, the tree's
    q / k / v, the output; the [B, N, N] ancestor mask and the prefix lengths are noise beside them."""
    nh, kvh, hd = geometry
    return 2 * (2 * B * S * kvh * hd + B * N * nh * hd + 2 * B * N * kvh * hd + B * N * nh * hd) + B * N * N


def bench_attention(B: int, N: int, S: int, args, bw: float, log, geometry=ATTN_GEOMETRY) -> dict:
    """Tree attention of one full-attention layer of the verify (committed prefix of S tokens, all valid, + a
    random tree of N nodes), XLA only: `concat_attend` is what `TargetModel.verify` runs (the cache and the
    tree's K/V concatenated, `attention.attend`), `two_part` is `attention.attend_prefix_tree` (no copy of the
    cache). Both against the floor: `attention_bytes` / copy bandwidth. On a GPU also the Pallas split-S kernel
    (`pallas_kernels.tree_attention`) in three tilings."""
    from hyspec_jax.attention import attend, attend_prefix_tree
    nh, kvh, hd = geometry
    depth = DEPTH_FOR_N.get(N, min(8, N - 1))
    parents = jnp.asarray(trees.random_parents(31 * B + N, B, N, depth - 1))
    tree_mask = trees.mask_from_parents(parents)
    prefix_mask = jnp.ones((B, S), bool)
    R = 4 if B * S >= 64 * 1024 else 8

    def make(i):
        ks = jax.random.split(jax.random.key(100 * i + B * N + S), 5)
        bf = jnp.bfloat16
        return (jax.random.normal(ks[0], (B, N, nh, hd)).astype(bf), jax.random.normal(ks[1], (B, S, kvh, hd)).astype(bf),
                jax.random.normal(ks[2], (B, S, kvh, hd)).astype(bf), jax.random.normal(ks[3], (B, N, kvh, hd)).astype(bf),
                jax.random.normal(ks[4], (B, N, kvh, hd)).astype(bf))
    sets = [make(i) for i in range(R)]

    def concat_attend(q, k, v, tk, tv):
        mask = jnp.concatenate([jnp.broadcast_to(prefix_mask[:, None], (B, N, S)), tree_mask], -1)
        return attend(q, jnp.concatenate([k, tk], 1), jnp.concatenate([v, tv], 1), mask)

    def two_part(q, k, v, tk, tv):
        return attend_prefix_tree(q, k, v, prefix_mask, tk, tv, tree_mask)

    ref = jax.block_until_ready(jax.jit(concat_attend)(*sets[0]))
    floor_us = 1e6 * attention_bytes(B, N, S, geometry) / bw
    out = {"B": B, "N": N, "S": S, "depth": depth, "geometry": list(geometry), "floor_us": floor_us, "variants": {}}
    peak = getattr(args, "matmul_flops", None)
    if peak:     # the roofline: the larger of the memory floor and the tensor-core floor
        out["compute_floor_us"] = 1e6 * attention_flops(B, N, S, geometry) / peak
        out["roofline_us"] = max(floor_us, out["compute_floor_us"])
    variants = {"xla_concat_attend": concat_attend, "xla_two_part": two_part}
    if args.attention_kernels:         # Pallas split-S prefix + XLA combine; on a CPU only when asked (interpret)
        from hyspec_jax.pallas_kernels.tree_attention import default_splits, prefix_tree_attention
        for tiling in getattr(args, "attention_tilings", None) or ATTN_TILINGS:
            block_rows, block_s, warps, stages = tuple(tiling) + (4, 2)[len(tiling) - 2:]
            splits = default_splits(B, N * nh // kvh, S, kvh, block_rows, block_s)
            tag = "" if (warps, stages) == (4, 2) else f"_w{warps}_g{stages}"
            variants[f"pallas_split_prefix_r{block_rows}_s{block_s}_x{splits}{tag}"] = (
                lambda q, k, v, tk, tv, br=block_rows, bs=block_s, sp=splits, nw=warps, ns=stages:
                prefix_tree_attention(q, k, v, prefix_mask, tk, tv, tree_mask, block_s=bs, splits=sp,
                                      block_rows=br, num_warps=nw, num_stages=ns,
                                      interpret=args.attention_kernels == "interpret"))
    for name, fn in variants.items():
        out["variants"][name] = rec = _measure(
            fn, sets, args.reps, lambda o: {"err_o": _rel(o, ref), "maxabs_o": _maxabs(o, ref)}, floor_us,
            getattr(args, "profile", False))
        if "roofline_us" in out and "median_us" in rec:
            rec["x_roofline"] = rec["median_us"] / out["roofline_us"]
            if "device_us" in rec:
                rec["device_x_roofline"] = rec["device_us"] / out["roofline_us"]
        log(f"  attention B={B:<3d} N={N:<3d} S={S:<6d} {name:<20s} " + (
            f"{rec['median_us']:10.1f} us  {rec['x_floor']:.2f}x floor  err_o {rec.get('err_o', float('nan')):.1e}"
            if "median_us" in rec else f"ERROR {rec.get('error', '')[:200]}"))
    return out


def summarize(results: dict) -> list[str]:
    lines = ["", "tree solve (us per call, median; speedup of the best kernel vs baselines)",
             f"{'B':>3} {'N':>3} {'d':>2} | {'best kernel':<28} {'us':>9} {'err_o':>8} | {'serial':>9} "
             f"{'xla_solve':>9} {'xla_neu':>9} {'xla_scan':>9} | {'x serial':>8} {'x xla':>7} {'floor%':>6}"]
    for r in results["tree"]:
        row = _tree_row(r)
        if row is None:
            lines.append(f"{r['B']:>3} {r['N']:>3} {r['depth']:>2} | no kernel result")
            continue
        lines.append(
            f"{r['B']:>3} {r['N']:>3} {r['depth']:>2} | {row['best']:<28} {row['us']:9.1f} {row['err_o']:8.1e} | "
            f"{row['serial_us']:9.1f} {row['xla_solve_us']:9.1f} {row['xla_neumann_us']:9.1f} "
            f"{row['xla_scan_us']:9.1f} | {row['x_serial']:8.2f} {row['x_xla']:7.2f} {row['pct_floor']:6.1f}"
            f"   (overhead probe {row['overhead_us']:.1f})")
        if "device_us" in row:
            lines.append(f"{'':>10}   GPU time (profiler): {row['device_best']} {row['device_us']:.1f} us, serial "
                         f"{row['device_serial_us']:.1f} ({row['device_x_serial']:.1f}x), XLA "
                         f"{row['device_xla_us']:.1f} ({row['device_x_xla']:.1f}x), {row['device_x_floor']:.2f}x floor")
    if results.get("commit"):
        lines += ["", f"commit over {results['commit'][0]['layers']} layers (us per call)"]
        for r in results["commit"]:
            v = r["variants"]
            parts = [f"{n}={x['median_us']:.1f} (err {x['err']:.1e})" for n, x in v.items() if "median_us" in x]
            lines.append(f"  B={r['B']:<3d} N={r['N']:<3d} floor={r['floor_us']:.1f}  " + "  ".join(parts))
    for r in results.get("deferred", []):
        v = r["variants"]
        t = lambda n: v.get(n, {}).get("median_us", float("nan"))  # noqa: E731
        lines.append(f"deferred commit B={r['B']} N={r['N']} over {r['layers']} layers: eager commit "
                     f"{t('commit_eager'):.1f} us; append " + ", ".join(
                         f"{n.removeprefix('append_')} {x['median_us']:.1f} us" for n, x in v.items()
                         if n.startswith("append_") and "median_us" in x))
        for p, x in r.get("per_round_layer_us", {}).items():
            lines.append(f"  {p}: per round and layer {x['eager']:.1f} us eager, {x['deferred']:.1f} us deferred "
                         f"(merge every {x['merge_every']} rounds)")
    return lines


def _best_against_baselines(v: dict, kern: dict, key: str) -> tuple[str, float, float]:
    """(best kernel by `key`, the serial kernel's and XLA's best `key`) among one entry's variants."""
    t = lambda n: v.get(n, {}).get(key, float("nan"))  # noqa: E731
    best = min((n for n in kern if key in kern[n]), key=t)
    serial = min([t(n) for n in v if n.startswith("serial_pallas")] or [float("nan")])
    xla = np.nanmin([t("xla_solve"), t("xla_neumann")]) if any(n in v for n in ("xla_solve", "xla_neumann")) \
        else float("nan")
    return best, serial, float(xla)


def _tree_row(r: dict) -> dict | None:
    """The best single-pass kernel of one (B, N) entry against its baselines, by the host-clock median and (GPU)
    by the profiler's device time; None without a kernel result."""
    v = r["variants"]
    t = lambda n: v.get(n, {}).get("median_us", float("nan"))  # noqa: E731
    kern = {n: x for n, x in v.items() if n.startswith("pallas_") and "median_us" in x and "tf32x3" not in n
            and x.get("err_o", 1.0) < 1e-2}
    if not kern:
        return None
    best, serial, xla = _best_against_baselines(v, kern, "median_us")
    row = {"B": r["B"], "N": r["N"], "depth": r["depth"], "best": best, "us": t(best), "err_o": kern[best]["err_o"],
           "serial_us": serial, "xla_us": xla, "xla_solve_us": t("xla_solve"), "xla_neumann_us": t("xla_neumann"),
           "xla_scan_us": t("xla_scan_paths"), "floor_us": r["floor_us"], "x_serial": serial / t(best),
           "x_xla": xla / t(best), "pct_floor": 100.0 * r["floor_us"] / t(best), "overhead_us": t("null_overhead")}
    mib = lambda n: v.get(n, {}).get("transient_bytes", float("nan")) / 2**20  # noqa: E731
    sname = min((n for n in v if n.startswith("serial_pallas") and "median_us" in v[n]), key=t, default=None)
    row.update(transient_mib=mib(best), serial_transient_mib=mib(sname) if sname else float("nan"),
               xla_transient_mib=mib("xla_solve"))
    if any("device_us" in x for x in kern.values()):     # GPU time per call from the profiler trace
        dbest, dserial, dxla = _best_against_baselines(v, kern, "device_us")
        d = kern[dbest]["device_us"]
        row.update(device_best=dbest, device_us=d, device_err_o=kern[dbest]["err_o"], device_serial_us=dserial,
                   device_xla_us=dxla, device_x_serial=dserial / d, device_x_xla=dxla / d,
                   device_x_floor=d / r["floor_us"])
    return row


def merge(paths: list[str]) -> dict:
    """Several result files as one: later files win per variant of each (B, N, depth) tree entry and each commit entry,
    and a later run of an entry brings its own fields too (its floor, from that run's copy bandwidth); an entry that
    measured no variant (all filtered out by --variants) adds nothing."""
    out: dict = {}
    tree: dict = {}
    commit: dict = {}
    attention: dict = {}
    deferred: dict = {}
    sections = (("tree", tree), ("commit", commit), ("attention", attention), ("deferred", deferred))
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        out.update({k: v for k, v in r.items() if k not in dict(sections)})
        for key, dest in sections:
            for e in r.get(key, []):
                if not e["variants"]:
                    continue
                cur = dest.setdefault((e["B"], e["N"], e.get("S"), e.get("depth")), {"variants": {}})
                cur.update({k: v for k, v in e.items() if k not in ("variants", "per_round_layer_us")})
                cur["variants"].update(e["variants"])
                if "per_round_layer_us" in e:
                    cur.setdefault("per_round_layer_us", {}).update(e["per_round_layer_us"])
    for key, dest in sections:
        out[key] = list(dest.values())
    out["merged_from"] = [str(p) for p in paths]
    return out


def render(results: dict, json_path: str) -> None:
    """OUT.md (tables) and OUT.png (best kernel vs the serial kernel, XLA and the HBM floor) beside OUT.json."""
    base = os.path.splitext(json_path)[0]
    meta = results.get("run_metadata", {})
    lines = [f"# GDN tree-verification kernels — {results.get('device_kind', '?')}", ""]
    if meta.get("command"):
        lines += [f"`{meta['command']}`", ""]
    lines += [f"commit {results.get('git_commit', meta.get('commit', '?'))}, jax {results.get('jax_version', '?')}, "
              f"copy bandwidth {results.get('copy_bandwidth_GBps', float('nan')):.0f} GB/s"
              + (f"; merged from {', '.join(results['merged_from'])}" if results.get("merged_from") else ""), "",
              "Geometry HK 16, HV 48, dk = dv = 128; bf16 q/k/v, fp32 state. Times: median µs per call over rotating "
              "input sets in one executable (a share of dispatch included: see the overhead column). Floor: fewest "
              "bytes / copy bandwidth. Transient: XLA's scratch allocation for one call (intermediates between "
              "kernels, e.g. the serial kernel's per-node states; not the outputs).", "",
              "| B | N | depth | best kernel (tf32) | µs | err o | serial Pallas | XLA masked_solve | XLA scan/path "
              "| × serial | × XLA | % of floor | overhead probe µs | transient MiB: kernel / serial / XLA |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted((x for x in map(_tree_row, results.get("tree", [])) if x is not None),
                  key=lambda x: (x["B"], x["N"]))
    for x in rows:
        lines.append(f"| {x['B']} | {x['N']} | {x['depth']} | {x['best'].removeprefix('pallas_')} | {x['us']:.1f} | "
                     f"{x['err_o']:.1e} | {x['serial_us']:.1f} | {x['xla_us']:.1f} | {x['xla_scan_us']:.0f} | "
                     f"{x['x_serial']:.1f} | {x['x_xla']:.1f} | {x['pct_floor']:.1f} | {x['overhead_us']:.1f} | "
                     f"{x.get('transient_mib', float('nan')):.1f} / {x.get('serial_transient_mib', float('nan')):.1f} / "
                     f"{x.get('xla_transient_mib', float('nan')):.1f} |")
    mrows = [x for x in rows if "device_us" in x]
    if mrows:
        lines += ["", "GPU time per call (`device_us`: the kernels of one call, summed from a `jax.profiler` trace of "
                  "3 more runs of the same executable — no dispatch, no idle gaps between launches):", "",
                  "| B | N | depth | best kernel (tf32) | µs | err o | serial Pallas µs | XLA masked_solve µs | × serial "
                  "| × XLA | × floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in mrows:
            lines.append(f"| {x['B']} | {x['N']} | {x['depth']} | {x['device_best'].removeprefix('pallas_')} | "
                         f"{x['device_us']:.1f} | {x['device_err_o']:.1e} | {x['device_serial_us']:.1f} | "
                         f"{x['device_xla_us']:.1f} | {x['device_x_serial']:.1f} | {x['device_x_xla']:.1f} | "
                         f"{x['device_x_floor']:.2f} |")
    if results.get("commit"):
        lines += ["", f"Commit of the accepted paths over {results['commit'][0]['layers']} GDN layers "
                  "(µs per call, S donated):", "", "| B | N | variant | µs | err | % of floor |", "|---|---|---|---|---|---|"]
        for r in results["commit"]:
            for n, x in r["variants"].items():
                if "median_us" in x:
                    lines.append(f"| {r['B']} | {r['N']} | {n} | {x['median_us']:.1f} | {x['err']:.1e} | "
                                 f"{x['pct_of_floor']:.1f} |")
    if results.get("attention"):
        lines += ["", "Tree attention of one full-attention layer (Qwen3.8-27B: 24 query heads, 4 KV heads, head_dim 256, "
                  "bf16), committed prefix of S tokens + N tree nodes; × floor = time / (fewest bytes / copy "
                  "bandwidth), the bar is 1.2; compute floor = matmul FLOPs / measured bf16 matmul rate "
                  f"({results.get('matmul_TFLOPs', float('nan')):.0f} TFLOP/s); × roofline = time / the larger "
                  "of the two floors. Pallas: host-clock median (GPU time in brackets):", "",
                  "| B | N | S | HBM floor µs | compute floor µs | concat + attend µs (verify today) | × floor | "
                  "two-part µs | × floor | best Pallas split-S (tiling) µs | × floor | × roofline |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(results["attention"], key=lambda r: (r["B"], r["N"], r["S"])):
            c, t = r["variants"].get("xla_concat_attend", {}), r["variants"].get("xla_two_part", {})
            f = lambda x, k: f"{x[k]:.1f}" if k in x else "—"  # noqa: E731
            g = lambda x: f"{x['x_floor']:.2f}" if "x_floor" in x else "—"  # noqa: E731
            ks = {n: x for n, x in r["variants"].items() if n.startswith("pallas_") and "median_us" in x
                  and x.get("err_o", 1.0) < 2e-2}
            best = min(ks, key=lambda n: ks[n]["median_us"]) if ks else None
            if best:
                kb = ks[best]
                dev = f" [{kb['device_us']:.1f}]" if "device_us" in kb else ""
                roof = f"{kb['x_roofline']:.2f}" if "x_roofline" in kb else "—"
                kcol = f"{kb['median_us']:.1f}{dev} ({best.removeprefix('pallas_split_prefix_')}) | {g(kb)} | {roof}"
            else:
                kcol = "— | — | —"
            cf = f"{r['compute_floor_us']:.1f}" if "compute_floor_us" in r else "—"
            lines.append(f"| {r['B']} | {r['N']} | {r['S']} | {r['floor_us']:.1f} | {cf} | {f(c, 'median_us')} | "
                         f"{g(c)} | {f(t, 'median_us')} | {g(t)} | {kcol} |")
    if results.get("deferred"):
        lines += ["", "Deferred commit (`gdn.DeferredUpdates`): the accepted paths (full depth, every request) appended "
                  "as factor rows over all GDN layers in one launch, merged by the next verify's tree solve; against "
                  "the eager factorized commit. µs per call (median); solve columns are one layer:", "",
                  "| B | N | layers | P | eager commit µs | append µs | append floor µs | solve µs | "
                  "solve + merge P rows µs | + write back µs | per round·layer eager µs | deferred µs (merge every R) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["deferred"]:
            v = r["variants"]
            f = lambda n: f"{v[n]['median_us']:.1f}" if "median_us" in v.get(n, {}) else "—"  # noqa: E731
            for p, x in r.get("per_round_layer_us", {}).items():
                lines.append(f"| {r['B']} | {r['N']} | {r['layers']} | {p[1:]} | {f('commit_eager')} | "
                             f"{f('append_' + p)} | "
                             f"{v.get('append_' + p, {}).get('floor_us', float('nan')):.1f} | "
                             f"{f('solve_plain')} | {f('solve_deferred_' + p)} | "
                             f"{f('solve_merge_' + p)} | {x['eager']:.1f} | {x['deferred']:.1f} "
                             f"({x['merge_every']}) |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if not rows:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"B{x['B']} N{x['N']}" for x in rows]
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    for key, name, m in (("serial_us", "serial Pallas (SGLang-style)", "s"), ("xla_us", "XLA masked_solve", "^"),
                         ("us", "our tree-solve kernel (best)", "o"), ("floor_us", "HBM floor", "_")):
        ax.plot(xs, [x[key] for x in rows], m, label=name, markersize=8)
    ax.set_yscale("log")
    ax.set_xticks(xs, labels, rotation=45, ha="right")
    ax.set_ylabel("µs per call (log)")
    ax.set_title(f"GDN tree solve, Qwen3.8-27B GDN geometry, {results.get('device_kind', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, base + ".png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hyspec bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", default="16,32,64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the profiler trace per variant that gives its GPU time per call (device_us, GPU only)")
    ap.add_argument("--layers", type=int, default=LG, help="GDN layers in the commit benchmark")
    ap.add_argument("--commit-nodes", type=int, default=64)
    ap.add_argument("--no-commit", action="store_true")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="regex (fullmatch) over variant names")
    ap.add_argument("--configs", type=parse_configs, default=None, metavar="B:N[:D],..",
                    help="tree-solve configurations, e.g. 1:64,32:64 (depth: DEPTH_FOR_N), 8:16:16 (a 16-node "
                         "chain); overrides the grid")
    ap.add_argument("--commit-batches", default=None, help="default: --batches")
    ap.add_argument("--attention", default=None, metavar="B:N:S,..",
                    help="also time the verify's tree attention (Qwen3.8-27B full-attention geometry) at these "
                         "batch:nodes:prefix configurations, e.g. 1:64:4096,8:64:4096")
    ap.add_argument("--attention-kernels", choices=("on", "off", "interpret"), default=None,
                    help="with --attention: also the Pallas split-S tree attention (default: on a GPU only; "
                         "interpret: Pallas interpret mode, for a CPU check)")
    ap.add_argument("--attention-tilings", type=parse_tilings, default=None, metavar="R:S[:W[:G]],..",
                    help="Pallas tree attention tilings: query rows and keys per block, warps (4), pipeline stages "
                         "(2); default: a sweep of eight")
    ap.add_argument("--deferred", default=None, metavar="B,..",
                    help="also time the deferred commit (append of the accepted paths over --layers GDN layers, "
                         "and the tree solve that merges them) against the eager commit at these batches, "
                         "N = --commit-nodes")
    ap.add_argument("--deferred-rows", default="16,32", help="update rows P per (layer, request, head)")
    ap.add_argument("--deferred-method", default="squaring", choices=("neumann", "squaring", "inverse"))
    ap.add_argument("--deferred-block-v", type=int, default=64)
    ap.add_argument("--no-tree", action="store_true", help="skip the GDN tree-solve sweep")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new configuration after this many seconds (what ran is written)")
    ap.add_argument("--merge", nargs="+", metavar="IN.json", default=None,
                    help="re-render result files as one (later files win per variant) into --json; no device")
    args = ap.parse_args(argv)
    if args.attention_kernels is None:
        args.attention_kernels = "on" if jax.default_backend() == "gpu" else "off"
    args.attention_kernels = None if args.attention_kernels == "off" else args.attention_kernels

    def log(s):
        print(s, flush=True)

    if args.merge:
        if not args.json:
            ap.error("--merge needs --json OUT.json")
        merged = merge(args.merge)
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=1)
        render(merged, args.json)
        log(f"wrote {args.json} and its .md / .png")
        return 0
    t_start = time.perf_counter()

    dev = jax.devices()[0]
    results = {"device_kind": dev.device_kind, "platform": dev.platform, "jax_version": jax.__version__,
               "git_commit": git_commit(), "geometry": {"HK": HK, "HV": HV, "dk": DK, "dv": DV},
               "dtypes": {"qkv": "bfloat16", "state": "float32", "o": "float32"},
               "reference": "gdn.masked_solve(method='solve'), fp32 precision HIGHEST, same bf16 inputs",
               "time_unit": "us per call", "tree": [], "commit": [], "deferred": [], "attention": [], "skipped": [],
               "run_metadata": {**run_metadata(), "command": portable_command(
                   "hyspec bench kernels", sys.argv[1:] if argv is None else argv)}}
    if dev.platform != "gpu":
        log("warning: no GPU; Pallas kernels will fail (this benchmark is for the device machine)")
    bw = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bw / 1e9
    log(f"device {dev.device_kind}, jax {jax.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.attention:
        args.matmul_flops = matmul_peak()
        results["matmul_TFLOPs"] = args.matmul_flops / 1e12
        log(f"bf16 matmul rate {args.matmul_flops / 1e12:.0f} TFLOP/s")

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if args.configs:
        configs = args.configs
    else:
        configs = [(B, N, None) for B in map(int, args.batches.split(",")) for N in map(int, args.nodes.split(","))]
    def out_of_time() -> bool:
        return args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds

    for B, N, D in ([] if args.no_tree else configs):
        if out_of_time():
            results["skipped"].append(f"tree {B}:{N}" + (f":{D}" if D else ""))
            continue
        results["tree"].append(bench_tree(B, N, args, bw, log, depth=D))
        save()
    if not args.no_commit:
        for B in map(int, (args.commit_batches or args.batches).split(",")):
            if out_of_time():
                results["skipped"].append(f"commit {B}:{args.commit_nodes}")
                continue
            results["commit"].append(bench_commit(B, args.commit_nodes, args, bw, log))
            save()
    for B in (map(int, args.deferred.split(",")) if args.deferred else []):
        if out_of_time():
            results["skipped"].append(f"deferred {B}:{args.commit_nodes}")
            continue
        results["deferred"].append(bench_deferred(B, args.commit_nodes, args, bw, log))
        save()
    for cfg in (args.attention.split(",") if args.attention else []):
        B, N, S = map(int, cfg.split(":"))
        if out_of_time():
            results["skipped"].append(f"attention {cfg}")
            continue
        results["attention"].append(bench_attention(B, N, S, args, bw, log))
        save()
    for line in summarize(results):
        log(line)
    if results["skipped"]:
        log(f"--max-seconds {args.max_seconds}: not measured: {', '.join(results['skipped'])}")
    save()
    if args.json:
        render(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
