"""Registers, spills and static shared memory of each Pallas kernel, as ptxas reports them (issue [kernels]).

    hyspec bench kernel-resources --json out.json [--batch 8 --nodes 64]

A child process compiles every kernel at the Qwen3.8-27B GDN geometry (shapes only: nothing is allocated or
run) with XLA dumping its PTX (`--xla_dump_to`); the PTX of each module goes through `ptxas -v` for the
H200's sm_90a, and the `Used N registers, M bytes smem` lines are matched to the kernels by the names our
`pallas_call`s give them. Triton kernels take their working shared memory dynamically at launch, so ptxas's
smem column is the static part only (say so, never guess the dynamic part). Needs a GPU backend (XLA's GPU
compiler) and a ptxas binary (PATH, $CUDA_HOME/bin, or the nvidia-cuda-nvcc wheel jax installs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

KERNELS = ("gdn_tree_solve_neumann", "gdn_tree_solve_squaring", "gdn_tree_solve_squaring_deferred",
           "gdn_path_commit", "gdn_deferred_append", "gdn_serial_tree", "tree_attention_prefix")

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas(text: str) -> dict[str, dict]:
    """`ptxas -v` output -> {entry: {registers, smem_static_bytes, stack_bytes, spill_store_bytes,
    spill_load_bytes}} for every compiled entry function."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line) or _PROPS.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {})
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            out[current].update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                                spill_load_bytes=int(m.group(3)))
        m = _USED.search(line)
        if m:
            out[current].update(registers=int(m.group(1)), smem_static_bytes=int(m.group(2) or 0))
    return out


def find_ptxas() -> str | None:
    cands = [shutil.which("ptxas")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ptxas"))
    for path in sys.path:
        cands += glob.glob(os.path.join(path, "nvidia", "cuda_nvcc", "bin", "ptxas"))
        cands += glob.glob(os.path.join(path, "nvidia", "cu*", "bin", "ptxas"))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def match_kernels(entries: dict[str, dict]) -> dict[str, dict]:
    """Our kernels among the entry functions (XLA may decorate the names): the longest of our names each
    entry contains."""
    out = {}
    for entry, info in entries.items():
        names = [k for k in KERNELS if k in entry]
        if names:
            out[max(names, key=len)] = {**info, "ptx_entry": entry}
    return out


JOBS = ("neumann", "squaring", "squaring_deferred", "commit", "append", "serial", "attention")


def _compile_job(B: int, N: int, only: str) -> None:
    """Child: compile one kernel (shapes only) so XLA dumps the PTX of its module alone."""
    import jax
    import jax.numpy as jnp

    from hyspec_jax.bench.kernels import DEPTH_FOR_N, DK, DV, HK, HV, LG
    from pallas_kernels.gdn_commit import deferred_append_pallas, path_commit_pallas
    from pallas_kernels.gdn_serial import serial_tree_pallas
    from pallas_kernels.gdn_tree_solve import tree_solve_pallas
    from pallas_kernels.tree_attention import prefix_tree_attention

    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sd = jax.ShapeDtypeStruct
    depth, P = DEPTH_FOR_N[N], 16
    tree = (sd((B, HV, DK, DV), f32), sd((B, N, HK, DK), bf16), sd((B, N, HK, DK), bf16), sd((B, N, HV, DV), bf16),
            sd((B, N, HV), f32), sd((B, N, HV), f32), sd((B, N, N), f32))
    deferred = (sd((B, HV), f32), sd((B, HV, P), f32), sd((B, P, HK, DK), bf16), sd((B, HV, P, DV), f32), sd((B,), i32))
    jobs = {
        "neumann": (lambda *a: tree_solve_pallas(*a, max_depth=depth, method="neumann"), tree),
        "squaring": (lambda *a: tree_solve_pallas(*a, max_depth=depth, method="squaring"), tree),
        "squaring_deferred": (lambda *a: tree_solve_pallas(*a[:7], a[7:], max_depth=depth, method="squaring",
                                                            write_state=True), tree + deferred),
        "commit": (lambda *a: path_commit_pallas(*a), (sd((LG, B, HV, DK, DV), f32), sd((LG, B, HV, N), f32),
                                                        sd((LG, B, N, HK, DK), bf16), sd((LG, B, HV, N, DV), f32),
                                                        sd((B, N, N), f32), sd((B,), i32))),
        "append": (lambda *a: deferred_append_pallas(a[:5], *a[5:]),
                   (sd((LG, B, HV), f32), sd((LG, B, HV, P), f32), sd((LG, B, P, HK, DK), bf16),
                    sd((LG, B, HV, P, DV), f32), sd((B,), i32), sd((LG, B, HV, N), f32), sd((LG, B, N, HK, DK), bf16),
                    sd((LG, B, HV, N, DV), f32), sd((B, depth), i32), sd((B,), i32))),
        "serial": (lambda *a: serial_tree_pallas(*a[:6], a[6], block_v=64), tree[:6] + (sd((B, N), i32),)),
        "attention": (lambda q, k, v, pm, tk, tv, tm: prefix_tree_attention(q, k, v, pm, tk, tv, tm, block_s=64,
                                                                              splits=8, block_rows=64),
                      (sd((B, N, 24, 256), bf16), sd((B, 4096, 4, 256), bf16), sd((B, 4096, 4, 256), bf16),
                       sd((B, 4096), jnp.bool_), sd((B, N, 4, 256), bf16), sd((B, N, 4, 256), bf16),
                       sd((B, N, N), jnp.bool_))),
    }
    for name, (fn, args) in jobs.items():
        if name != only:
            continue
        try:
            jax.jit(fn).lower(*args).compile()
            print(f"compiled {name}", flush=True)
        except Exception as e:  # noqa: BLE001 — one kernel failing to compile must not hide the others
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def run(B: int, N: int, log=print) -> dict:
    import jax
    out: dict = {"batch": B, "nodes": N, "arch": "sm_90a", "kernels": {}, "notes": []}
    if jax.default_backend() != "gpu":
        out["error"] = "needs a GPU backend: XLA's GPU compiler emits the PTX"
        return out
    ptxas = find_ptxas()
    if ptxas is None:
        out["error"] = "no ptxas binary found (PATH, $CUDA_HOME/bin, nvidia-cuda-nvcc wheel)"
        return out
    out["ptxas"] = ptxas
    out["jobs"] = {}
    for job in JOBS:                # one child and one dump per kernel: its module's entries are its own
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()}
            child = subprocess.run([sys.executable, "-c", "from hyspec_jax.bench.kernel_resources import "
                                    f"_compile_job; _compile_job({B}, {N}, {job!r})"], env=env, capture_output=True,
                                   text=True)
            entries: dict[str, dict] = {}
            for path in sorted(glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)):
                res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", "-o", os.devnull, path],
                                     capture_output=True, text=True)
                entries.update(parse_ptxas(res.stdout + res.stderr))
            files = sorted(os.path.relpath(f, dump) for f in glob.glob(os.path.join(dump, "**", "*"), recursive=True))
            out["jobs"][job] = {"compile_log": (child.stdout + child.stderr)[-1500:], "entries": entries,
                                "dump_files": files[:80], "dump_file_count": len(files)}
            mine = match_kernels(entries)
            if not mine and entries:          # the name did not survive: the module's heaviest entry is ours
                entry = max(entries, key=lambda e: entries[e].get("registers", 0))
                mine = {f"({job})": {**entries[entry], "ptx_entry": entry, "matched": "most registers in module"}}
            out["kernels"].update(mine)
        log(f"{job}: {len(entries)} PTX entries, {len(files)} dump files")
    out["notes"].append("smem_static_bytes is the static shared memory only: Triton kernels take their working "
                        "shared memory dynamically at launch")
    missing = [j for j, x in out["jobs"].items() if not x["entries"]]
    if missing:
        out["notes"].append(f"no PTX entries for: {', '.join(missing)} (see jobs[...].compile_log / dump_files)")
    out["notes"].append("a kernel named '(job)' was not found by name: it is the entry with the most registers in "
                        "that job's module (all entries are in jobs[...].entries)")
    return out


def render(res: dict) -> list[str]:
    lines = [f"Pallas kernels at B = {res['batch']}, N = {res['nodes']} (Qwen3.8-27B GDN geometry), ptxas -v for "
             f"{res['arch']}:", "", "| kernel | registers / thread | spill stores B | spill loads B | stack B | "
             "static smem B |", "|---|---|---|---|---|---|"]
    for name, x in res["kernels"].items():
        if x:
            lines.append(f"| {name} ({x.get('ptx_entry', '?')}) | {x.get('registers', '—')} | {x.get('spill_store_bytes', '—')} | "
                         f"{x.get('spill_load_bytes', '—')} | {x.get('stack_bytes', '—')} | "
                         f"{x.get('smem_static_bytes', '—')} |")
    return lines + [""] + [f"- {n}" for n in res.get("notes", [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hyspec bench kernel-resources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here (and a .md table beside it)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=64, choices=(16, 32, 64, 128))
    args = ap.parse_args(argv)
    from hyspec_jax.bench.report import run_metadata
    res = {**run(args.batch, args.nodes), "run_metadata": {**run_metadata(), "command": "hyspec bench kernel-resources "
                                                             + " ".join(sys.argv[1:] if argv is None else argv)}}
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
