"""Where a speculative round's time goes: `hyspec bench round-profile --json out.json`.

For each mode (ar and the speculative ones), one held-out prompt (or `--batch` of them, decoded together by the
request loop a server runs, each step dispatched before the one in flight is read) is generated twice to compile
and warm, once untimed-by-the-profiler (the wall time per round, as `hyspec bench e2e` sees it) and once under `jax.profiler`.
From the trace's GPU stream events: the GPU's busy time per round (the union of its kernels, copies and
memsets), the number of GPU operations per round (≈ kernel launches), and the largest kernels. A round whose wall
time is far above its GPU busy time is bound by the host (launching the executable's kernels, Python), not by the
GPU — that is the regime of a small model at batch 1, and there the speed-up over `ar` follows the ratio of
launches per round to launches per decoding step more than the GPU work.

On a machine without a GPU the trace has no GPU planes: the wall times are reported, the GPU columns are empty.
The profiler slows the host, so the traced wall time is reported separately from the untraced one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


MODES = ("ar", "chain", "ready", "tree", "tree-ready")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench round-profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="OUT.json", help="results (a .md table next to it)")
    p.add_argument("--model", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: MODEL/drafter)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompts", default=None, help="prompt pack (.npz: tokens, domain, domains); default: the "
                                                   "held-out prompts of `hyspec bench e2e`")
    p.add_argument("--prompt-index", type=int, default=0, help="which prompt of the pack (the first of --batch)")
    p.add_argument("--batch", type=int, default=1,
                   help="requests decoded together: the pack's prompts from --prompt-index on, in that many slots "
                        "(default 1); per-round figures are per decoding step of the whole batch")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--kernels", choices=("auto", "reference"), default="auto")
    p.add_argument("--tree-depth", type=int, default=None, help="tree levels (default: the drafter's γ)")
    p.add_argument("--tree-topk", type=int, default=8)
    p.add_argument("--tree-beam", type=int, default=16)
    p.add_argument("--verify-nodes", type=int, default=32)
    p.add_argument("--hlo", default=None, metavar="DIR",
                   help="also write each speculative mode's compiled round (its optimized HLO, the kernels the trace "
                        "names, with their named scopes) to DIR/round_MODE.hlo.txt")
    p.add_argument("--top", type=int, default=12, help="largest kernels kept per mode")
    return p


def summarize_events(events: list[tuple[int, int, str]], rounds: int, top: int) -> dict:
    """Per-round GPU figures of a traced generation of `rounds` rounds."""
    from hyspec_jax.bench.report import busy_time_ns
    r = max(rounds, 1)
    per: dict[str, list[float]] = {}
    for _, d, n in events:
        c = per.setdefault(n, [0, 0.0])
        c[0] += 1
        c[1] += d
    biggest = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return {"gpu_ops_per_round": len(events) / r, "gpu_busy_us_per_round": busy_time_ns(events) / 1e3 / r,
            "top_kernels": [{"name": n[:160], "per_round": c / r, "us_per_round": t / 1e3 / r}
                            for n, (c, t) in biggest]}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from hyspec_jax.bench.e2e import DEFAULT_PROMPTS, _default_model, load_models, make_engine
    from hyspec_jax.bench.phases import round_kernels
    from hyspec_jax.bench.report import gpu_stream_events, portable_command, portable_path, profile_trace, run_metadata
    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.tree import TreeExpansion
    from hyspec_jax.train.distill import load_prompts

    if a.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    dt = jnp.float32 if a.dtype == "float32" else jnp.bfloat16
    model_dir = Path(a.model) if a.model else _default_model()
    drafter_dir = Path(a.drafter) if a.drafter else model_dir / "drafter"
    tokens, _, _ = load_prompts(a.prompts or str(DEFAULT_PROMPTS))
    if a.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {a.batch}")
    if not 0 <= a.prompt_index <= len(tokens) - a.batch:
        raise ValueError(f"--prompt-index {a.prompt_index} with --batch {a.batch} runs past the pack's "
                         f"{len(tokens)} prompts")
    prompts = [[int(t) for t in tokens[i]] for i in range(a.prompt_index, a.prompt_index + a.batch)]
    target, drafters = load_models(model_dir, drafter_dir, dt, any(m != "ar" for m in a.modes))
    depth = a.tree_depth or (drafters[False].config.num_draft_tokens if drafters else 0)
    params = SamplingParams(max_tokens=a.max_tokens)

    rows = {}
    for mode in tqdm(a.modes, desc="round-profile", unit="mode"):
        eng = make_engine(target, drafters, mode, a.batch, kernels=a.kernels,
                          tree=TreeExpansion(depth, a.tree_topk, a.tree_beam), verify_nodes=a.verify_nodes)
        if eng is None:
            raise ValueError(f"mode {mode}: the drafter in {drafter_dir} has no ReaDy reader")
        eng.generate(prompts, params)
        eng.generate(prompts, params)                       # compiled and warm
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        rounds, tau = eng.last_stats.rounds, eng.last_stats.tau
        box = {}

        def traced_run():
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            box["s"] = time.perf_counter() - t0
        events = gpu_stream_events(profile_trace(traced_run))       # none without a GPU
        traced = box["s"]
        n_tokens = sum(len(r.token_ids) for r in res)
        row = {"rounds": rounds, "tau": tau, "tokens": n_tokens,
               "wall_us_per_round": 1e6 * wall / max(rounds, 1),
               "traced_wall_us_per_round": 1e6 * traced / max(rounds, 1),
               "tokens_per_s": n_tokens / wall if wall > 0 else 0.0}
        if events:
            row.update(summarize_events(events, rounds, a.top))
            row["gpu_busy_share"] = row["gpu_busy_us_per_round"] / row["traced_wall_us_per_round"]
        if mode != "ar":      # the compiled round's kernels by phase (named scopes), and a decoding step's
            hlo = None
            if a.hlo:
                Path(a.hlo).mkdir(parents=True, exist_ok=True)
                hlo = str(Path(a.hlo) / f"round_{mode}.hlo.txt")
            row["compiled_kernels"] = round_kernels(eng, prompts, params, hlo)
        rows[mode] = row

    report = {**run_metadata(), "command": portable_command("hyspec bench round-profile", argv or sys.argv[1:]),
              "model": portable_path(model_dir), "dtype": a.dtype, "kernels": a.kernels,
              "max_tokens": a.max_tokens, "prompt_index": a.prompt_index, "batch": a.batch,
              "tree": {"depth": depth, "top_k": a.tree_topk, "beam": a.tree_beam, "verify_nodes": a.verify_nodes},
              "modes": rows}
    from hyspec_jax.bench.report import write_report
    write_report(report, a.json, markdown)
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    rows = report["modes"]
    ar = rows.get("ar")
    batch = report.get("batch", 1)
    prompts = (f"one held-out prompt, {report['max_tokens']} new tokens" if batch == 1 else
               f"{batch} held-out prompts, {report['max_tokens']} new tokens each, decoded together")
    lines = [f"# Where a round's time goes ({report.get('device_kind', '?')}, {report['dtype']}, batch {batch})",
             "", f"`{report['command']}` — commit {report.get('commit', '?')}; {prompts}. "
             "Wall: untraced, per round (ar: per decoding step). GPU busy: the "
             "union of the round's GPU operations in a profiler trace; GPU ops: kernels, copies and memsets per "
             "round (≈ launches). × ar: per round, against one decoding step.", "",
             "| mode | τ | wall µs / round | × ar | GPU busy µs / round | × ar | GPU busy / traced wall | GPU ops / round "
             "| × ar | largest kernels (µs / round) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(mode: str, key: str) -> str:
        if ar is None or key not in ar or key not in rows[mode] or not ar[key]:
            return "—"
        return f"{rows[mode][key] / ar[key]:.2f}"

    kern = {m: r["compiled_kernels"] for m, r in rows.items() if "compiled_kernels" in r}
    tail = []
    if kern:
        scopes = sorted({s for k in kern.values() for s in k["round"]},
                        key=lambda s: -max(k["round"].get(s, 0) for k in kern.values()))
        tail = ["", "Kernels of the compiled round by phase (`jax.named_scope`; `compilation.kernel_count_by_scope`), "
                "against one decoding step of the same bucket:", "",
                "| mode | decoding step | round | " + " | ".join(scopes) + " |",
                "|---|---|---|" + "---|" * len(scopes)]
        for m, k in kern.items():
            tail.append(f"| {m} | {k['ar_step']} | {k['round_total']} | "
                        + " | ".join(str(k["round"].get(s, 0)) for s in scopes) + " |")
    for mode, r in rows.items():
        busy = f"{r['gpu_busy_us_per_round']:.0f}" if "gpu_busy_us_per_round" in r else "—"
        share = f"{100 * r['gpu_busy_share']:.0f}%" if "gpu_busy_share" in r else "—"
        ops = f"{r['gpu_ops_per_round']:.0f}" if "gpu_ops_per_round" in r else "—"
        top = "; ".join(f"{k['name'][:40]} {k['us_per_round']:.0f}" for k in r.get("top_kernels", [])[:3]) or "—"
        lines.append(f"| {mode} | {r['tau']:.2f} | {r['wall_us_per_round']:.0f} | {ratio(mode, 'wall_us_per_round')} | "
                     f"{busy} | {ratio(mode, 'gpu_busy_us_per_round')} | {share} | {ops} | "
                     f"{ratio(mode, 'gpu_ops_per_round')} | {top} |")
    return "\n".join(lines + tail) + "\n"


if __name__ == "__main__":
    sys.exit(main())
