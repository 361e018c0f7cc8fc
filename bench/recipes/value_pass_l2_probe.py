"""Is split_mgpu's Mosaic GPU value pass bound by reading its state from HBM? It runs twice in a row on the same
state (the second call finds what the first left in L2) and once per fresh input set; the per-launch device times of
the first (cold) and second (warm) call are compared. Writes JSON to argv[1].

    python3 bench/recipes/value_pass_l2_probe.py out.json
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np

from bench.kernels import DK, DV, HV, value_pass_inputs
from bench.report import gpu_stream_events, profile_trace, run_metadata
from hyspec_jax.pallas_kernels import gdn_tree_split_mgpu


def probe(B: int, sets: int = 4, reps: int = 5) -> dict:
    interpret = jax.default_backend() != "gpu"          # the CPU smoke run: interpret mode, no device trace
    inputs = [value_pass_inputs(7919 * i + B * 64, B, interpret=interpret) for i in range(sets)]

    def two_calls(ins):
        outs = []
        for gamma, *rest in ins:
            outs.append(gdn_tree_split_mgpu.tree_apply_mgpu(gamma, *rest, interpret=interpret))
            # the same state again (Γ nudged so XLA keeps both launches): its tiles are in L2 if they stayed
            outs.append(gdn_tree_split_mgpu.tree_apply_mgpu(gamma * (1 + 2 ** -20), *rest, interpret=interpret))
        return outs

    f = jax.jit(two_calls)
    if interpret:                                       # one run: the code path, no timing
        return {"B": B, "interpret": True, "outputs": len(jax.block_until_ready(f(inputs)))}
    jax.block_until_ready(f(inputs))                    # compile
    jax.block_until_ready(f(inputs))                    # warm

    def run():
        for _ in range(reps):
            jax.block_until_ready(f(inputs))

    ev = [d / 1e3 for _, d, name in gpu_stream_events(profile_trace(run)) if "gdn_tree_apply_mgpu" in name]
    cold, warm = ev[0::2], ev[1::2]
    return {"B": B, "state_MB": B * HV * DK * DV * 4 / 1e6, "launches": len(ev),
            "cold_us": float(np.median(cold)), "warm_us": float(np.median(warm)),
            "cold_all": cold, "warm_all": warm}


if __name__ == "__main__":
    res = {**run_metadata(), "probes": [probe(B) for B in ((1, 2, 4, 8) if jax.default_backend() == "gpu" else (1,))]}
    for p in res["probes"]:
        if p.get("interpret"):
            print(f"B={p['B']} interpret mode: {p['outputs']} outputs (no device trace off a GPU)")
            continue
        print(f"B={p['B']:<3d} state {p['state_MB']:6.1f} MB  value pass cold {p['cold_us']:6.1f} us  "
              f"warm (same state again) {p['warm_us']:6.1f} us")
    json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "value_pass_l2_probe.json", "w"), indent=1)
