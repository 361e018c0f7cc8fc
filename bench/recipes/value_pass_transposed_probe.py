"""The transposed value pass's register knobs (gdn_tree_split_mgpu._apply_transposed_kernel: key chunk width, a
wgmma wait per chunk, o's accumulator starting at e^Γ ⊙ (Q S0)ᵀ) against the plain value pass with the same fp16
[M; C M]: each form's outputs against the plain one's, its device µs per launch (median of a profiler trace) and,
with MOSAIC_GPU_DUMP_PTXAS=1 set, ptxas' register count in the log. Writes JSON to argv[1]. GPU only.

    MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/recipes/value_pass_transposed_probe.py out.json
"""
from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels import value_pass_inputs
from bench.report import gpu_stream_events, profile_trace, run_metadata
from pallas_kernels import gdn_tree_split_mgpu as mg

KNOBS = {"t_c64": dict(), "t_c64_wait": dict(chunk_wait=True), "t_c32": dict(chunk=32),
         "t_c32_wait": dict(chunk=32, chunk_wait=True), "t_c64_init": dict(acc_init=True),
         "t_c64_wait_init": dict(chunk_wait=True, acc_init=True), "t_c32_init": dict(chunk=32, acc_init=True),
         "t_c32_wait_init": dict(chunk=32, chunk_wait=True, acc_init=True)}


def forms():
    cp = mg.plgpu.CompilerParams(lowering_semantics=mg.plgpu.LoweringSemantics.Warpgroup)
    out = {"plain": mg.tree_apply_mgpu}
    for name, knobs in KNOBS.items():
        out[name] = jax.jit(functools.partial(mg._tree_apply_transposed, bv=64, out_dtype=jnp.float32,
                                              compiler_params=cp, interpret=False, **knobs))
    return out


def rel(a, b) -> float:
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


def probe(B: int, reps: int = 20) -> dict:
    ins = value_pass_inputs(101 + B, B)
    res = {"B": B, "forms": {}}
    plain = None
    for name, f in forms().items():
        try:
            o, vc = jax.block_until_ready(f(*ins))
        except Exception as e:                          # a form that does not compile is a reading, not a crash
            res["forms"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        if plain is None:
            plain = (o, vc)
        def run(f=f):
            for _ in range(reps):
                jax.block_until_ready(f(*ins))
        ev = [d / 1e3 for _, d, n in gpu_stream_events(profile_trace(run)) if "gdn_tree_apply_mgpu" in n]
        res["forms"][name] = {"us": float(np.median(ev)), "launches": len(ev),
                              "rel_o_vs_plain": rel(o, plain[0]), "rel_vc_vs_plain": rel(vc, plain[1])}
    return res


if __name__ == "__main__":
    out = {**run_metadata(), "probes": [probe(B) for B in (8, 16, 32, 1)]}
    for p in out["probes"]:
        for name, r in p["forms"].items():
            line = r.get("error") or (f"{r['us']:7.2f} us  o vs plain {r['rel_o_vs_plain']:.1e}  "
                                      f"V' vs plain {r['rel_vc_vs_plain']:.1e}")
            print(f"B={p['B']:<3d} {name:18s} {line}")
    json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "value_pass_transposed_probe.json", "w"), indent=1)
