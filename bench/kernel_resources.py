"""Registers, shared memory and launch shape of each Pallas kernel, as Nsight Compute reads them.

    hyspec bench kernel-resources --json out.json [--batch 8 --nodes 64]

One child process per kernel builds zero inputs at the Qwen3.8-27B GDN geometry, compiles the kernel and runs
it once under `ncu` (launch statistics and the kernel's duration only: `--clock-control none`, no hardware
counters needed beyond the timer). Each launch's registers per thread, static and dynamic shared memory (Triton
kernels take their working shared memory dynamically), block and grid size and duration are matched to our
kernels by the names our `pallas_call`s give them (ncu profiles only launches with those names; XLA keeps them,
as seen on the H200). (XLA 0.11's `--xla_dump_to` writes no PTX for Triton custom calls, so `ptxas -v` on
dumped PTX cannot read them.) Needs a GPU and `ncu` (PATH, $CUDA_HOME/bin or
/opt/nvidia/nsight-compute).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

KERNELS = ("gdn_tree_solve_neumann", "gdn_tree_solve_squaring", "gdn_tree_solve_squaring_deferred",
           "gdn_tree_solve_inverse", "gdn_tree_apply_mgpu", "gdn_tree_operators",
           "gdn_tree_apply",
           "gdn_path_commit", "gdn_deferred_append", "gdn_serial_tree", "tree_attention_prefix")

_SHORT = {"launch__registers_per_thread": "registers", "launch__shared_mem_per_block_static": "smem_static_bytes",
          "launch__shared_mem_per_block_dynamic": "smem_dynamic_bytes", "launch__block_size": "block_threads",
          "launch__grid_size": "grid_blocks", "launch__waves_per_multiprocessor": "waves",
          "gpu__time_duration.sum": "duration_ns"}     # ncu metric → our name
NCU_METRICS = tuple(_SHORT)


def _number(text: str):
    t = text.replace(",", "").strip()
    try:
        return int(t)
    except ValueError:
        try:
            return float(t)
        except ValueError:
            return t


def parse_ncu_csv(text: str, all_columns: bool = False) -> list[dict]:
    """`ncu --csv --page raw --print-units base` output -> one dict per kernel launch: name + our metric names
    (all_columns: every metric column, by ncu's name). ncu's own log lines (==PROF==, ==WARNING==) and the units
    row are skipped."""
    import csv
    rows = [r for r in csv.reader(line for line in text.splitlines() if line.startswith('"'))]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        return []
    cols = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(cols) or not r[cols.index("ID")].strip():
            continue                                     # the units row has no ID
        rec = {"name": r[cols.index("Kernel Name")]}
        if all_columns:
            rec.update({c: _number(x) for c, x in zip(cols, r) if "__" in c})
            out.append(rec)
            continue
        for metric, short in _SHORT.items():
            if metric in cols:
                rec[short] = _number(r[cols.index(metric)])
        out.append(rec)
    return out


def find_ncu() -> str | None:
    cands = [shutil.which("ncu")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ncu"))
    cands += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True) + ["/usr/local/cuda/bin/ncu"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def match_kernels(launches: list[dict]) -> dict[str, dict]:
    """Our kernels among the launches (XLA may decorate the names): the longest of our names each name
    contains; a kernel launched more than once keeps its first launch."""
    out: dict[str, dict] = {}
    for rec in launches:
        names = [k for k in KERNELS if k in rec["name"]]
        if names:
            out.setdefault(max(names, key=len), dict(rec))
    return out


JOBS = ("neumann", "squaring", "neumann_bv32", "squaring_bv32", "neumann_bv128", "squaring_bv128",
        "inverse", "inverse_bv32", "inverse_bv128", "split", "split_bv32", "split_bv128",
        "split_mgpu", "split_mgpu_chpair", "split_mgpu_bv16", "split_mgpu_bv32",
        "squaring_deferred", "commit", "append", "append_l4", "serial", "attention")
# --detail: a second ncu pass per job with these sections (hardware counters: stall reasons, occupancy, memory)
DETAIL_SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis", "LaunchStats")


def _compile_job(B: int, N: int, only: str) -> None:
    """Child: compile one kernel and run it once on zero inputs (under ncu in the parent's command)."""
    import jax
    import jax.numpy as jnp

    from hyspec_jax import kernels
    from hyspec_jax.bench.kernels import DEPTH_FOR_N, DK, DV, HK, HV, LG, solve
    from hyspec_jax.pallas_kernels.gdn_commit import deferred_append_pallas, path_commit_pallas
    from hyspec_jax.pallas_kernels.gdn_serial import serial_tree_pallas

    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sd = jax.ShapeDtypeStruct
    depth, P = DEPTH_FOR_N[N], 16
    tree = (sd((B, HV, DK, DV), f32), sd((B, N, HK, DK), bf16), sd((B, N, HK, DK), bf16), sd((B, N, HV, DV), bf16),
            sd((B, N, HV), f32), sd((B, N, HV), f32), sd((B, N, N), f32))
    deferred = (sd((B, HV), f32), sd((B, HV, P), f32), sd((B, P, HK, DK), bf16), sd((B, HV, P, DV), f32), sd((B,), i32))
    append_args = (sd((LG, B, HV), f32), sd((LG, B, HV, P), f32), sd((LG, B, P, HK, DK), bf16),
                   sd((LG, B, HV, P, DV), f32), sd((B,), i32), sd((LG, B, HV, N), f32), sd((LG, B, N, HK, DK), bf16),
                   sd((LG, B, HV, N, DV), f32), sd((B, depth), i32), sd((B,), i32))
    jobs = {
        "neumann": (lambda *a: solve(*a, path_nodes=depth, method="neumann"), tree),
        "squaring": (lambda *a: solve(*a, path_nodes=depth, method="squaring"), tree),
        **{f"{m}_bv{bv}": (lambda *a, m=m, bv=bv: solve(*a, path_nodes=depth, method=m, block_v=bv), tree)
           for m in ("neumann", "squaring", "inverse", "split") for bv in (32, 128)},
        "inverse": (lambda *a: solve(*a, path_nodes=depth, method="inverse"), tree),
        "split": (lambda *a: solve(*a, path_nodes=depth, method="split"), tree),
        "split_mgpu": (lambda *a: solve(*a, path_nodes=depth, method="split_mgpu"), tree),
        "split_mgpu_chpair": (lambda *a: solve(*a, path_nodes=depth, method="split_mgpu", operator_chain="pair"), tree),
        **{f"split_mgpu_bv{bv}": (lambda *a, bv=bv: solve(*a, path_nodes=depth, method="split_mgpu", block_v=bv), tree)
           for bv in (16, 32)},
        "squaring_deferred": (lambda *a: solve(*a[:7], a[7:], path_nodes=depth, method="squaring", write_state=True),
                              tree + deferred),
        "commit": (lambda *a: path_commit_pallas(*a), (sd((LG, B, HV, DK, DV), f32), sd((LG, B, HV, N), f32),
                                                        sd((LG, B, N, HK, DK), bf16), sd((LG, B, HV, N, DV), f32),
                                                        sd((B, N, N), f32), sd((B,), i32))),
        # every request appends a full-depth path (zero inputs would append nothing); 1 or 4 layers a program
        **{f"append{sfx}": (lambda *a, lb=lb: deferred_append_pallas(
            a[:5], *a[5:8], jnp.broadcast_to(jnp.arange(depth, dtype=i32), (B, depth)), jnp.full((B,), depth, i32),
            layers_per_program=lb), append_args) for sfx, lb in (("", 1), ("_l4", 4))},
        "serial": (lambda *a: serial_tree_pallas(*a[:6], a[6], block_v=64), tree[:6] + (sd((B, N), i32),)),
        # the tiling the dispatcher picks at this batch (hyspec_jax.kernels.attention_tiling)
        "attention": (lambda q, k, v, pm, tk, tv, tm: kernels.tree_attention(q, k, v, pm, tk, tv, tm, impl="pallas"),
                      (sd((B, N, 24, 256), bf16), sd((B, 4096, 4, 256), bf16), sd((B, 4096, 4, 256), bf16),
                       sd((B, 4096), jnp.bool_), sd((B, N, 4, 256), bf16), sd((B, N, 4, 256), bf16),
                       sd((B, N, N), jnp.bool_))),
    }
    for name, (fn, args) in jobs.items():
        if name != only:
            continue
        try:
            compiled = jax.jit(fn).lower(*args).compile()
            jax.block_until_ready(compiled(*[jnp.zeros(a.shape, a.dtype) for a in args]))
            print(f"ran {name}", flush=True)
        except Exception as e:  # noqa: BLE001 — one kernel failing to compile must not hide the others
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def _child(B: int, N: int, job: str) -> list[str]:
    """ncu's target: only our kernels (XLA's own are not profiled), in a child that compiles and runs one job."""
    return ["--target-processes", "all", "--kernel-name", "regex:" + "|".join(KERNELS), sys.executable, "-c",
            f"from hyspec_jax.bench.kernel_resources import _compile_job; _compile_job({B}, {N}, {job!r})"]


def _ncu_job(ncu: str, B: int, N: int, job: str, timeout_s: float, detail: bool) -> tuple:
    """One child under ncu: (rc, log, csv text)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "ncu.csv")
        what = [a for sec in DETAIL_SECTIONS for a in ("--section", sec)] if detail else \
            ["--clock-control", "none", "--metrics", ",".join(NCU_METRICS)]
        cmd = [ncu, *what, "--csv", "--page", "raw", "--print-units", "base", "--log-file", report,
               *_child(B, N, job)]
        try:
            child = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            rc, child_log = child.returncode, child.stdout + child.stderr
        except subprocess.TimeoutExpired as e:     # one kernel must not cost the others their report
            rc, child_log = "timeout", f"timed out after {timeout_s} s: {e.stdout or ''}{e.stderr or ''}"
        text = ""
        if os.path.isfile(report):
            with open(report) as f:
                text = f.read()
    return rc, child_log, text


def parse_sass_csv(text: str) -> dict[str, list[dict]]:
    """`ncu --import R --page source --csv --print-source sass` output -> per kernel name, one dict per SASS
    instruction: opcode (the mnemonic without predicate or modifiers), warp-level instructions executed, stall
    samples and the samples per stall reason."""
    import csv

    def num(x: str):
        v = _number(x)
        return v if isinstance(v, (int, float)) else 0                  # "-": none
    out: dict[str, list[dict]] = {}
    kernel, cols = None, None
    for row in csv.reader(line for line in text.splitlines() if line.startswith('"')):
        if row and row[0] == "Kernel Name":
            kernel, cols = row[1], None
            continue
        if kernel is None:
            continue
        if cols is None:
            cols = row
            src, execd = cols.index("Source"), cols.index("Instructions Executed")
            samples = cols.index("Warp Stall Sampling (All Samples)")
            stalls = {i: c[len("stall_"):] for i, c in enumerate(cols) if c.startswith("stall_") and "(" not in c}
            continue
        if len(row) != len(cols):
            continue
        words = row[src].split()
        if not words:
            continue
        mnemonic = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        out.setdefault(kernel, []).append({
            "opcode": mnemonic.split(".")[0], "executed": num(row[execd]), "samples": num(row[samples]),
            "stalls": {name: num(row[i]) for i, name in stalls.items() if num(row[i])}})
    return out


def opcode_mix(instructions: list[dict], top: int = 16) -> dict:
    """Instructions executed and stall samples per opcode, as shares of the kernel's, largest sample share first;
    each with its three largest stall reasons (share of all samples)."""
    executed = sum(x["executed"] for x in instructions) or 1
    samples = sum(x["samples"] for x in instructions) or 1
    by: dict[str, dict] = {}
    for x in instructions:
        rec = by.setdefault(x["opcode"], {"executed": 0, "samples": 0, "stalls": {}})
        rec["executed"] += x["executed"]
        rec["samples"] += x["samples"]
        for k, v in x["stalls"].items():
            rec["stalls"][k] = rec["stalls"].get(k, 0) + v
    rows = sorted(by.items(), key=lambda kv: -kv[1]["samples"])[:top]
    return {"executed": executed, "samples": samples, "static_instructions": len(instructions),
            "opcodes": [{"opcode": op, "executed_pct": 100 * r["executed"] / executed,
                         "samples_pct": 100 * r["samples"] / samples,
                         "stalls_pct": {k: 100 * v / samples
                                        for k, v in sorted(r["stalls"].items(), key=lambda kv: -kv[1])[:3]}}
                        for op, r in rows]}


def _ncu_sass_job(ncu: str, B: int, N: int, job: str, timeout_s: float) -> tuple:
    """One child under ncu's SourceCounters (per-instruction counts and stall sampling), exported as the SASS
    source page: (rc, log, csv text)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "sass")
        cmd = [ncu, "--section", "SourceCounters", "-f", "-o", report, *_child(B, N, job)]
        try:
            child = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            rc, child_log = child.returncode, child.stdout + child.stderr
            export = subprocess.run([ncu, "--import", report + ".ncu-rep", "--page", "source", "--csv",
                                     "--print-source", "sass"], capture_output=True, text=True, timeout=120)
            text = export.stdout if export.returncode == 0 else ""
            child_log += export.stderr
        except subprocess.TimeoutExpired as e:
            rc, child_log, text = "timeout", f"timed out: {e.stdout or ''}{e.stderr or ''}", ""
    return rc, child_log, text


def run(B: int, N: int, log=print, timeout_s: float = 90.0, jobs: tuple = JOBS, detail: bool = False,
        sass: bool = False) -> dict:
    import jax
    out: dict = {"batch": B, "nodes": N, "kernels": {}, "notes": []}
    if jax.default_backend() != "gpu":
        out["error"] = "needs a GPU backend: the kernels run once under ncu"
        return out
    ncu = find_ncu()
    if ncu is None:
        out["error"] = "no ncu (Nsight Compute) found (PATH, $CUDA_HOME/bin, /opt/nvidia/nsight-compute)"
        return out
    out["ncu"] = ncu
    out["jobs"] = {}
    for job in jobs:                # one child per kernel: its launches are its own
        rc, child_log, text = _ncu_job(ncu, B, N, job, timeout_s, detail=False)
        launches = parse_ncu_csv(text)
        out["jobs"][job] = {"rc": rc, "log": str(child_log)[-1500:],
                            "ncu_tail": text[-800:] if not launches else "", "launches": launches[:40]}
        # ncu profiled our kernels only: one per job, two for the split form (its second under "job/kernel")
        keyed = lambda found: {(job if i == 0 else f"{job}/{k}"): rec for i, (k, rec) in enumerate(found.items())}  # noqa: E731
        mine = match_kernels(launches)
        out["kernels"].update(keyed(mine))
        if detail and mine:
            rc, child_log, text = _ncu_job(ncu, B, N, job, 2 * timeout_s, detail=True)
            full = match_kernels(parse_ncu_csv(text, all_columns=True))
            out["jobs"][job]["detail_rc"] = rc
            for key, rec in keyed(full).items():
                if key in out["kernels"]:
                    out["kernels"][key]["detail"] = rec
            if not full:
                out["jobs"][job]["detail_log"] = (str(child_log) + text)[-1500:]
        if sass and mine:
            rc, child_log, text = _ncu_sass_job(ncu, B, N, job, 3 * timeout_s)
            per_kernel = match_kernels([{"name": k, "sass": v} for k, v in parse_sass_csv(text).items()])
            out["jobs"][job]["sass_rc"] = rc
            for key, rec in keyed(per_kernel).items():
                if key in out["kernels"]:
                    out["kernels"][key]["sass"] = opcode_mix(rec["sass"])
            if not per_kernel:
                out["jobs"][job]["sass_log"] = str(child_log)[-1500:]
        log(f"{job}: {len(launches)} launches, ours: {', '.join(x['name'] for x in mine.values()) or 'none'}")
    out["notes"].append("one run on zero inputs per kernel under ncu --clock-control none; duration is that one "
                        "launch's (ncu serializes launches), not a benchmark")
    if sass:
        out["notes"].append("sass: a further run per kernel under ncu's SourceCounters (instruction counts are "
                            "exact; stall samples are a statistical sample of warp states)")
    if detail:
        out["notes"].append("detail: a second run per kernel with the ncu sections " + ", ".join(DETAIL_SECTIONS)
                            + " (hardware counters; ncu replays the kernel, so its duration there is not used)")
    missing = [j for j, x in out["jobs"].items() if not x["launches"]]
    if missing:
        out["notes"].append(f"no launches recorded for: {', '.join(missing)} (see jobs[...].log / ncu_tail)")
    return out


def render(res: dict) -> list[str]:
    lines = [f"Pallas kernels at B = {res['batch']}, N = {res['nodes']} (Qwen3.8-27B GDN geometry), Nsight Compute "
             "launch statistics:", "", "| kernel | registers / thread | static smem B | dynamic smem B | block | grid | "
             "waves / SM | µs (one launch) |", "|---|---|---|---|---|---|---|---|"]
    for name, x in res["kernels"].items():
        dur = x.get("duration_ns")
        us = f"{dur / 1e3:.1f}" if isinstance(dur, (int, float)) else "—"
        lines.append(f"| {name} ({x.get('name', '?')[:60]}) | {x.get('registers', '—')} | "
                     f"{x.get('smem_static_bytes', '—')} | {x.get('smem_dynamic_bytes', '—')} | "
                     f"{x.get('block_threads', '—')} | {x.get('grid_blocks', '—')} | {x.get('waves', '—')} | {us} |")
    detailed = {n: x["detail"] for n, x in res["kernels"].items() if isinstance(x.get("detail"), dict)}
    if detailed:
        lines += ["", "Hardware counters (`--detail`): achieved occupancy, DRAM throughput and its share of peak, local-"
                  "memory spill requests, the four largest stall reasons (warps stalled per issued instruction):", "",
                  "| kernel | occupancy % | DRAM TB/s | DRAM % of peak | spill requests | top stalls |",
                  "|---|---|---|---|---|---|"]
        for name, d in detailed.items():
            num = lambda key: d.get(key) if isinstance(d.get(key), (int, float)) else float("nan")  # noqa: E731
            stalls = {k.split("issue_stalled_")[1].split("_per_")[0]: v for k, v in d.items()
                      if "warps_issue_stalled_" in k and k.endswith("per_issue_active.ratio")
                      and isinstance(v, (int, float))}
            top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:4])
            lines.append(f"| {name} | {num('sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
                         f"{num('dram__bytes.sum.per_second') / 1e12:.2f} | "
                         f"{num('dram__cycles_active.avg.pct_of_peak_sustained_elapsed'):.1f} | "
                         f"{num('derived__local_spilling_requests'):.0f} | {top or '—'} |")
    mixed = {n: x["sass"] for n, x in res["kernels"].items() if isinstance(x.get("sass"), dict)}
    for name, m in mixed.items():
        launch = res["kernels"][name]
        warps = (launch.get("grid_blocks") or 1) * max(1, (launch.get("block_threads") or 32) // 32)
        per_warp = m["executed"] / warps
        lines += ["", f"Instruction mix of {name} (`--sass`: ncu SourceCounters; {m['executed']:,.0f} warp "
                  f"instructions, {per_warp:,.0f} per warp, {m['static_instructions']:,} in the code; stall samples "
                  f"{m['samples']:,.0f}), the opcodes with the most stall samples:", "",
                  "| opcode | % of instructions | % of samples | largest stall reasons (% of samples) |",
                  "|---|---|---|---|"]
        for r in m["opcodes"]:
            stalls = ", ".join(f"{k} {v:.1f}" for k, v in r["stalls_pct"].items())
            lines.append(f"| {r['opcode']} | {r['executed_pct']:.1f} | {r['samples_pct']:.1f} | {stalls or '—'} |")
    return lines + [""] + [f"- {n}" for n in res.get("notes", [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hyspec bench kernel-resources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here (and a .md table beside it)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=64, choices=(16, 32, 64, 128))
    ap.add_argument("--jobs", default=None, help="comma-separated subset of: " + ", ".join(JOBS))
    ap.add_argument("--detail", action="store_true",
                    help="also collect stall reasons, occupancy and memory traffic (ncu sections, a second run each)")
    ap.add_argument("--sass", action="store_true",
                    help="also the instruction mix: instructions executed and stall samples per SASS opcode (ncu "
                         "SourceCounters, a further run each)")
    args = ap.parse_args(argv)
    jobs = JOBS if args.jobs is None else tuple(j.strip() for j in args.jobs.split(",") if j.strip())
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        print(f"hyspec bench kernel-resources: unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}",
              file=sys.stderr)
        return 2
    from hyspec_jax.bench.report import portable_command, run_metadata
    command = portable_command("hyspec bench kernel-resources", sys.argv[1:] if argv is None else argv)
    res = {**run(args.batch, args.nodes, jobs=jobs, detail=args.detail, sass=args.sass),
           "run_metadata": {**run_metadata(), "command": command}}
    if "error" in res:
        print(f"hyspec bench kernel-resources: {res['error']}", file=sys.stderr)
        return 1
    lines = render(res)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write("\n".join(["# Kernel resources", ""] + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
