"""Host cost of one decoding step, compared across checkouts: `python -m hyspec_jax.bench.dispatch_cost`.

Plain decoding of the embedded model is bound by the host launching each step (`bench/results/profile/`), so a
slower step usually means more host work per step. For every batch B this measures, on the checkout it runs
from and on each `--base` checkout (run in a subprocess with that checkout's own package, cwd its root):

  dispatch_us       the jitted step's call returning (no block_until_ready), median over `--calls` calls, the
                    device idle before each call (the loop's steady state when the host bounds it): the jit's
                    argument flattening, checks and launch (on a CPU the calling thread also runs part of the
                    executable); dispatch_cpu_us the calling thread's CPU time of the same call (a shared host's
                    waits left out); args_only_us the same arguments into an empty program (the jit's own part);
  backend_us        the same through the backend (`ARBackend.dispatch`: host copies of the inputs, the step's
                    output copy started) — what the request loop calls;
  loop_host_us      the request loop's own host work per step, outside the backend's calls: a `generate` of
                    `--max-tokens` tokens timed with every backend call (prefill, dispatch, collect) subtracted,
                    divided by the steps; backend construction (the fresh buffers of each `generate`) beside it;
  step_us           a whole `generate`'s wall time per step (device time included; on a CPU it dominates);
  arg_leaves        the pytree leaves the jitted step takes (each is checked and passed on every call);
  hlo               the compiled step (`compiled.as_text()`): instructions, and in the entry computation and
                    the computations it calls (loops, conditionals) the fusions, custom calls and the other
                    ops that launch work on a GPU (copies, dynamic-update-slices, scatters, ...): "launches" is
                    their sum, a rough count of kernels per step (the CPU compiler fuses differently from the
                    GPU's, so compare checkouts on one machine).

With `--spec-mode tree-ready` (or another speculative mode) the same for one speculative round.

Every checkout, this one included, runs in its own process; with `--rounds R` the checkouts take turns R times
(a drift of a shared host's speed then falls on all of them) and each timing is the median over the rounds.

    python -m hyspec_jax.bench.dispatch_cost --json bench/results/profile/dispatch_cost_cpu.json --base OLD_CHECKOUT

On the GPU machine (package not installed): `ln -sfn $PWD/bench hyspec_jax/bench; PYTHONPATH=$PWD python3 -m
hyspec_jax.bench.dispatch_cost --json $OUT/dispatch.json --base OLD_CHECKOUT` (OLD_CHECKOUT needs no link: the
worker runs this file with the old checkout's package).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAUNCH_OPS = ("fusion", "custom-call", "copy", "dynamic-update-slice", "dynamic-slice", "scatter", "gather",
              "dot", "convolution", "sort", "reduce", "all-reduce", "all-gather", "while", "conditional",
              "copy-start", "collective-permute")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hyspec_jax.bench.dispatch_cost", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="OUT.json", help="results (a .md table next to it)")
    p.add_argument("--base", nargs="*", default=[], metavar="CHECKOUT",
                   help="other checkouts (repository roots) to measure alike, each in its own process")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--spec-mode", default="ar", help="ar (default) or a speculative mode (tree-ready, chain, ...)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per dispatch measurement")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of the timed generate")
    p.add_argument("--repeats", type=int, default=3, help="timed generates (the median is reported)")
    p.add_argument("--rounds", type=int, default=1, help="turns of every checkout, one after another")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--model", default=None, help="target directory, its drafter in MODEL/drafter (default: each "
                                                 "checkout's embedded model)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------------------------------------
# HLO statistics
# ------------------------------------------------------------------------------------------------
_OP = re.compile(r"=\s.*?\s([a-z][\w-]*)\(")          # "%x = SHAPE op(" -> op (a tuple shape has spaces)
_CALLED = re.compile(r"\b(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def hlo_stats(text: str) -> dict:
    """Counts of a compiled module's text: instructions in all computations; in the entry computation and the
    loop / conditional / call computations it reaches (not fusion bodies), each op that launches work
    (LAUNCH_OPS; "launches" leaves out the while / conditional ops themselves)."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" ") and not line.startswith("HloModule"):
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line)
    ops: dict[str, int] = {}
    seen, todo = set(), [entry] if entry else []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            m = _OP.search(line)
            if not m:
                continue
            op = m.group(1)
            if op in LAUNCH_OPS:
                ops[op] = ops.get(op, 0) + 1
            if op in ("while", "conditional", "call"):
                todo += _CALLED.findall(line)
                for group in _BRANCHES.findall(line):
                    todo += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
    return {"instructions": sum(len(v) for v in comps.values()), "computations": len(comps),
            "launches": sum(v for k, v in ops.items() if k not in ("while", "conditional")),
            "ops": dict(sorted(ops.items()))}


# ------------------------------------------------------------------------------------------------
# Worker: measures the checkout whose `hyspec_jax` is imported
# ------------------------------------------------------------------------------------------------
def _median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def _timed(call, n: int, clock=time.perf_counter) -> list[float]:
    """Seconds (by `clock`) until each of n calls returns, the device idle before each (10 untimed first)."""
    import jax
    out = []
    for _ in range(10):
        jax.block_until_ready(call())
    for _ in range(n):
        t0 = clock()
        r = call()
        out.append(clock() - t0)
        jax.block_until_ready(r)
    return out


def measure(a: argparse.Namespace) -> dict:
    """Every batch of `a.batch` on the checkout whose `hyspec_jax` is imported."""
    import jax
    import jax.numpy as jnp

    import hyspec_jax
    from hyspec_jax.embedded import default_drafter_dir, default_model_dir
    from hyspec_jax.io.hf import load_pretrained

    if a.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")     # as `hyspec bench e2e`
    dt = jnp.float32 if a.dtype == "float32" else jnp.bfloat16
    model_dir = Path(a.model) if a.model else default_model_dir()
    _, target = load_pretrained(model_dir, dtype=dt)
    drafter = None
    if a.spec_mode != "ar":       # the model's drafter (a checkout of code alone has no default one)
        from hyspec_jax.io.drafter_io import load_drafter
        drafter = load_drafter(model_dir / "drafter" if a.model else default_drafter_dir(), dtype=dt,
                               with_reader="ready" in a.spec_mode)
    root = Path(hyspec_jax.__file__).resolve().parent.parent
    return {"checkout": root.name, "commit": _commit(root), "mode": a.spec_mode,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "batches": {str(B): measure_batch(a, target, drafter, B) for B in a.batch}}


def measure_batch(a: argparse.Namespace, target, drafter, B: int) -> dict:
    """One batch: the step's dispatch, its compiled program and the request loop's host work (module docstring)."""
    import jax
    import numpy as np

    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.spec.engine import SpecConfig, SpecEngine

    eng = SpecEngine(target, drafter, SpecConfig(mode=a.spec_mode), slots=B)     # as `hyspec bench e2e`
    owner = eng._ar if a.spec_mode == "ar" else eng         # what builds the backend and runs `generate`
    kv_len = 128
    t0 = time.perf_counter()
    be = owner.backend(B, kv_len)
    build_first = time.perf_counter() - t0
    be.compile(progress=None, stochastic=(False,), prompt_lengths=[24])
    builds = []
    for _ in range(20):
        t0 = time.perf_counter()
        be = owner.backend(B, kv_len)
        builds.append(time.perf_counter() - t0)
    samp = be.sampling(np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.int32),
                       np.zeros(B, np.uint32))
    active, steps = np.ones(B, bool), np.zeros(B, np.int32)

    # the jitted program and its arguments, as the backend passes them
    if a.spec_mode == "ar":
        from hyspec_jax.runtime.programs import ar_step_jit as fn
        args = (be.graphdef, be.params, be.state, be.anchor, active, samp, steps)
        kw = {"stochastic": False}

        def raw_call():
            be.anchor, be.state = fn(be.graphdef, be.params, be.state, be.anchor, active, samp, steps, **kw)
            return be.anchor

        def backend_call():
            return be.dispatch(active, samp, steps, False)[0]
    else:
        from hyspec_jax.spec.round import pack_round_inputs
        from hyspec_jax.spec.round import spec_round_io_jit as fn
        shape = be.round_shapes[False]
        packed = pack_round_inputs(active, steps, be.capacity, None)
        args = (be.graphdef, be.params, be.dgraph, be.dparams, be.state, be.dstate, be.anchor, samp, packed)
        kw = {"shape": shape}

        def raw_call():
            be.state, be.dstate, be.anchor, out = fn(be.graphdef, be.params, be.dgraph, be.dparams, be.state,
                                                     be.dstate, be.anchor, samp, packed, **kw)
            return out

        def backend_call():
            return be.dispatch(active, samp, steps, False)
    leaves = [x for x in jax.tree.leaves(args) if hasattr(x, "shape")]
    hlo = hlo_stats(getattr(fn, "jit", fn).lower(*args, **kw).compile().as_text())
    # the same arguments into a program that returns one of them: the jit's own cost per call (flattening,
    # checks, donation bookkeeping), apart from running the step's executable
    trivial = jax.jit(lambda g, *rest, **k: rest[-1], static_argnums=(0,), static_argnames=tuple(kw))
    args_only = _timed(lambda: trivial(*args, **kw), a.calls)
    raw = _timed(raw_call, a.calls)
    # the calling thread's CPU time alone: what the host spends, not the wall time it waited (a shared host)
    raw_cpu = _timed(raw_call, a.calls, time.thread_time)
    via = _timed(backend_call, a.calls)
    loop = _loop_host(owner, type(be), [[(7 * i + 3 * j) % 1000 + 5 for j in range(24)] for i in range(B)],
                      SamplingParams(max_tokens=a.max_tokens), a.repeats)
    return {"dispatch_us": _median_us(raw), "dispatch_cpu_us": _median_us(raw_cpu),
            "dispatch_p90_us": round(float(np.percentile(raw, 90)) * 1e6, 1),
            "args_only_us": _median_us(args_only), "backend_us": _median_us(via),
            **loop, "build_us": _median_us(builds), "build_first_s": round(build_first, 3),
            "arg_leaves": len(leaves), "hlo": hlo}


def _loop_host(owner, backend_cls, prompts, params, repeats: int) -> dict:
    """`owner.generate(prompts)` (one warm call first) with the backend's prefill / dispatch / collect and the
    backend's construction timed: per step, the loop's own host work (wall less all of those), the backend
    calls, and the whole generate."""
    spent = dict.fromkeys(("prefill", "dispatch", "collect", "build"), 0.0)
    counts = {"dispatch": 0}
    orig = {k: getattr(backend_cls, k) for k in ("prefill", "dispatch", "collect")}
    orig_build = type(owner).backend

    def wrap(k, f):
        def timed(*x, **y):
            t0 = time.perf_counter()
            try:
                return f(*x, **y)
            finally:
                spent[k] += time.perf_counter() - t0
                counts[k] = counts.get(k, 0) + 1
        return timed

    owner.generate(prompts, params)          # warm: the generate-sized prefill compiles
    rows = []
    for k, f in orig.items():
        setattr(backend_cls, k, wrap(k, f))
    type(owner).backend = wrap("build", orig_build)
    try:
        for _ in range(repeats):
            for k in spent:
                spent[k] = 0.0
            counts["dispatch"] = 0
            t0 = time.perf_counter()
            owner.generate(prompts, params)
            rows.append({"wall": time.perf_counter() - t0, "steps": max(counts["dispatch"], 1), **spent})
    finally:
        for k, f in orig.items():
            setattr(backend_cls, k, f)
        type(owner).backend = orig_build

    def per_step(r, key):
        return r[key] / r["steps"]

    med = statistics.median
    return {"loop_host_us": round(med((r["wall"] - r["prefill"] - r["dispatch"] - r["collect"] - r["build"])
                                     / r["steps"] for r in rows) * 1e6, 1),
            "backend_dispatch_in_loop_us": round(med(per_step(r, "dispatch") for r in rows) * 1e6, 1),
            "collect_in_loop_us": round(med(per_step(r, "collect") for r in rows) * 1e6, 1),
            "step_us": round(med(per_step(r, "wall") for r in rows) * 1e6, 1),
            "steps": int(med(r["steps"] for r in rows))}


def _commit(root: Path) -> str:
    if not (root / ".git").exists():       # a plain copy: not the commit of whatever repository holds it
        return ""
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ------------------------------------------------------------------------------------------------
# Driver: this checkout in-process, each --base in a subprocess
# ------------------------------------------------------------------------------------------------
def _worker_argv(a: argparse.Namespace) -> list[str]:
    out = ["--json", "-", "--batch", *map(str, a.batch), "--spec-mode", a.spec_mode, "--calls", str(a.calls),
           "--max-tokens", str(a.max_tokens), "--repeats", str(a.repeats), "--dtype", a.dtype, "--worker"]
    return out + (["--model", str(Path(a.model).resolve())] if a.model else [])


def run_checkout(root: Path, a: argparse.Namespace) -> dict:
    """Measure another checkout in a subprocess: its own `hyspec_jax` first on the path, cwd its root."""
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *_worker_argv(a)], cwd=root, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{root}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'failed'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def merge_rounds(runs: list[dict]) -> dict:
    """One checkout's rounds as one run: every timing the median over the rounds (each round's value kept under
    "rounds"); the counts, equal in every round, as they are."""
    out = {**runs[0], "batches": {}}
    for B, first in runs[0]["batches"].items():
        row = dict(first)
        for k in first:
            if k.endswith(("_us", "_s")):
                vals = [r["batches"][B][k] for r in runs]
                row[k] = round(statistics.median(vals), 1 if k.endswith("_us") else 3)
                row.setdefault("rounds", {})[k] = vals
        out["batches"][B] = row
    return out


COLUMNS = (("dispatch µs", "dispatch_us"), ("dispatch CPU µs", "dispatch_cpu_us"),
           ("same args, empty program µs", "args_only_us"), ("backend µs", "backend_us"),
           ("loop host µs / step", "loop_host_us"), ("backend build µs", "build_us"), ("generate µs / step", "step_us"),
           ("arg leaves", "arg_leaves"))


def markdown(report: dict) -> str:
    runs = report["runs"]
    head = ["checkout", "batch", *(c for c, _ in COLUMNS), "HLO instr", "launches", "fusions", "copies",
            "custom calls"]
    lines = [f"# Host cost of one {report['mode']} step", "", f"`{report['command']}`", "",
             f"device: {runs[0]['device']}, jax {runs[0]['jax']}", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in runs:
        for B, x in r["batches"].items():
            ops = x["hlo"]["ops"]
            cells = [f"{r['checkout']} {r['commit']}".strip(), B, *(x[k] for _, k in COLUMNS),
                     x["hlo"]["instructions"], x["hlo"]["launches"], ops.get("fusion", 0), ops.get("copy", 0),
                     ops.get("custom-call", 0)]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.calls, a.repeats, a.rounds, *a.batch) < 1 or a.max_tokens < 2:
        print("error: --calls, --repeats, --rounds and --batch must be >= 1, --max-tokens >= 2", file=sys.stderr)
        return 2
    if a.worker:
        print(json.dumps(measure(a)))
        return 0
    roots = [Path(b).resolve() for b in a.base]
    for r in roots:
        if not (r / "hyspec_jax" / "__init__.py").is_file():
            print(f"error: {r} is not a checkout (no hyspec_jax/)", file=sys.stderr)
            return 2
    import hyspec_jax
    roots = [Path(hyspec_jax.__file__).resolve().parent.parent] + roots       # this checkout first
    try:
        turns = [[run_checkout(r, a) for r in roots] for _ in range(a.rounds)]
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    runs = [merge_rounds([t[i] for t in turns]) for i in range(len(roots))]
    from hyspec_jax.bench.report import portable_command, run_metadata
    report = {**run_metadata(), "command": portable_command("python -m hyspec_jax.bench.dispatch_cost", argv or sys.argv[1:]),
              "mode": a.spec_mode, "runs": runs}
    from hyspec_jax.bench.report import write_report
    write_report(report, a.json, markdown)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
