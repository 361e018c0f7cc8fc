"""Where does a program of split_mgpu's Mosaic GPU value pass spend its time? Mosaic GPU's profiler
(`tree_apply_mgpu(profile_dir=...)`) records each program's phases (the kernel's named scopes: issue_loads,
wait_state, split_state, state_products, wait_rows, r_pair, wait_mc, mc_products, stage_outputs, store_outputs);
this prints per-phase medians and percentiles, programs per SM, and the waves, and writes them as JSON to argv[1].

    python3 bench/recipes/value_pass_phases.py out.json

Phase times are SM clock cycles (the profiler reads %clock within a program), shown also as µs at the SM clock;
program starts are the global timer's ns. The profiled launch is timed beside the plain one (the profiler's own
cost: a timer write per phase edge). On the CPU it runs the kernel once in interpret mode (no profile).
"""
from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels import value_pass_inputs
from bench.report import gpu_stream_events, profile_trace, run_metadata
from hyspec_jax.pallas_kernels import gdn_tree_split_mgpu


def sm_clock_mhz() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return float(out[0]) if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def parse(trace: dict, mhz: float) -> dict:
    """Per program (tid): phase durations (cycles: the profiler's ts is (start ns + cycles since it) / 1e3) and its
    start (µs, the global timer) and end (start + its cycles at `mhz`)."""
    progs = defaultdict(list)
    for ev in trace["traceEvents"]:
        progs[(ev["pid"], ev["tid"])].append(ev)
    phases = defaultdict(list)
    spans = []
    for (sm, _), evs in progs.items():
        open_at = {}
        for ev in evs:
            if ev["ph"] == "B":
                open_at[ev["name"]] = ev["ts"]
            elif ev["name"] in open_at:
                phases[ev["name"]].append((ev["ts"] - open_at.pop(ev["name"])) * 1e3)     # cycles
        cycles = (evs[-1]["ts"] - evs[0]["ts"]) * 1e3
        # start: the global timer (µs); end: start + the program's cycles at the SM clock
        spans.append((sm, evs[0]["ts"], evs[0]["ts"] + (cycles / mhz if mhz else 0.0), cycles))
    t0 = min(s[1] for s in spans)
    starts = np.array([s[1] - t0 for s in spans])                                       # µs (ns timer + cycles)
    lengths = np.array([s[3] for s in spans])
    # programs per SM at each program's start: how many of the same SM's programs are running then
    by_sm = defaultdict(list)
    for sm, a, b, _ in spans:
        by_sm[sm].append((a, b))
    concurrent = [sum(1 for a2, b2 in by_sm[sm] if a2 <= a < b2) for sm, a, b, _ in spans]
    us = lambda c: c / mhz if mhz else None                                              # noqa: E731
    stat = lambda x: {"median_cycles": float(np.median(x)), "p10_cycles": float(np.percentile(x, 10)),     # noqa: E731
                      "p90_cycles": float(np.percentile(x, 90)), "median_us": us(float(np.median(x))),
                      "count": len(x)}
    first_wave = lengths[starts < 0.5]
    later = lengths[starts >= 0.5]
    return {"programs": len(spans), "sms": len(by_sm), "phases": {k: stat(v) for k, v in phases.items()},
            "program_cycles": stat(lengths), "first_wave_program_cycles": stat(first_wave) if len(first_wave) else None,
            "later_program_cycles": stat(later) if len(later) else None,
            "max_programs_per_sm_at_start": int(max(concurrent)),
            "median_programs_per_sm_at_start": float(np.median(concurrent)),
            "last_start_us": float(starts.max()), "span_us": float(max(s[2] for s in spans) - t0),
            # how evenly the programs spread over the SMs, and when each SM's last one ends (µs from the first start)
            "programs_per_sm_min_max": [min(map(len, by_sm.values())), max(map(len, by_sm.values()))],
            "sm_end_us_p10_p50_max": [float(x) for x in np.percentile(
                [max(b for _, b in v) - t0 for v in by_sm.values()], [10, 50, 100])]}


def probe(B: int, mhz: float | None, reps: int = 5) -> dict:
    interpret = jax.default_backend() != "gpu"
    args = value_pass_inputs(7919 + B * 64, B, interpret=interpret)
    if interpret:                                       # the CPU smoke run: the kernel's code path, no profile
        o, vc = gdn_tree_split_mgpu.tree_apply_mgpu(*args, interpret=True)
        return {"B": B, "interpret": True, "o_finite": bool(jnp.isfinite(o).all())}
    res = {"B": B}
    plain = gdn_tree_split_mgpu.tree_apply_mgpu         # jitted already
    jax.block_until_ready(plain(*args))

    def run():
        for _ in range(reps):
            jax.block_until_ready(plain(*args))

    ev = [d / 1e3 for _, d, name in gpu_stream_events(profile_trace(run)) if "gdn_tree_apply_mgpu" in name]
    res["plain_us"] = float(np.median(ev))
    d = tempfile.mkdtemp(prefix=f"phases_b{B}_")
    prof = functools.partial(gdn_tree_split_mgpu.tree_apply_mgpu, profile_dir=d)      # profile_dir is static
    for _ in range(3):
        jax.block_until_ready(prof(*args))
    jax.effects_barrier()

    def run_prof():
        jax.block_until_ready(prof(*args))

    ev = [d_ / 1e3 for _, d_, name in gpu_stream_events(profile_trace(run_prof)) if "gdn_tree_apply_mgpu" in name]
    res["profiled_us"] = float(np.median(ev)) if ev else None
    jax.effects_barrier()
    files = sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
    res["trace_files"] = len(files)
    if files:
        res.update(parse(json.load(open(files[-1])), mhz or 0.0))
    return res


if __name__ == "__main__":
    gpu = jax.default_backend() == "gpu"
    mhz = sm_clock_mhz()
    cases = [8, 16, 1, 4] if gpu else [1]
    res = {**run_metadata(), "sm_clock_mhz": mhz, "probes": []}
    out = sys.argv[1] if len(sys.argv) > 1 else "value_pass_phases.json"
    for B in cases:
        try:
            p = probe(B, mhz)
        except Exception as e:                          # noqa: BLE001 — one failed case must not lose the others
            p = {"B": B, "error": f"{type(e).__name__}: {e}"[:2000]}
        res["probes"].append(p)
        json.dump(res, open(out, "w"), indent=1)
        if "error" in p or p.get("interpret"):
            print(p)
            continue
        print(f"\nB={B}: plain {p['plain_us']:.1f} us, profiled {p['profiled_us']} us, "
              f"{p.get('programs')} programs on {p.get('sms')} SMs, programs per SM at start: max "
              f"{p.get('max_programs_per_sm_at_start')}, median {p.get('median_programs_per_sm_at_start')}; "
              f"last start {p.get('last_start_us', 0):.1f} us, span {p.get('span_us', 0):.1f} us; programs per "
              f"SM (min, max) {p.get('programs_per_sm_min_max')}, SMs' last end (p10, p50, max) "
              f"{[round(x, 1) for x in p.get('sm_end_us_p10_p50_max', [])]} us")
        print(f"{'phase':16s} {'median cyc':>10s} {'p10':>8s} {'p90':>8s} {'median us':>9s}")
        for name, s in list(p.get("phases", {}).items()) + [("program", p.get("program_cycles")),
                                                            ("first wave", p.get("first_wave_program_cycles")),
                                                            ("later", p.get("later_program_cycles"))]:
            if s:
                print(f"{name:16s} {s['median_cycles']:10.0f} {s['p10_cycles']:8.0f} {s['p90_cycles']:8.0f} "
                      f"{(s['median_us'] or 0):9.2f}")
