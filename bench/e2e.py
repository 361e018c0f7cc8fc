"""End-to-end speculative decoding, Spec-Bench style: per domain and mode, tokens/s, speed-up over `ar` of the
same engine, τ, per-position acceptance and prefix survival (ReaDy's censoring rule), and an output-equality
check against `ar` in every run.

    hyspec bench e2e --json bench/results/e2e/e2e_h200.json [--model checkpoints/default]
                     [--drafter checkpoints/default/drafter] [--modes ar chain ready tree tree-ready]
                     [--batch 1 8] [--prompts-per-domain 4] [--max-tokens 128] [--repeats 3]
                     [--sweep-nodes 8 16 32 64]      # Bole Fig. 11 analogue: tok/s vs verified nodes per request

On the GPU machine (package not installed): `ln -s $PWD/bench hyspec_jax/bench; ln -s $PWD/train
hyspec_jax/train; PYTHONPATH=$PWD python -m hyspec_jax.bench.e2e --json $OUT/e2e.json`.

Prompts: `bench/data/heldout_prompts.npz`, 16 windows of 32 tokens per domain from the corpus *validation* split
(documents the target and drafter never trained on; `hyspec build-distill --prompts-only` format). Greedy.
Timing: every (mode, batch) configuration first runs one domain untimed (compiles), then `repeats` timed passes
over all domains, round-robin over the configurations (a drift of the machine's speed during the run then falls
on every mode alike: run one after another, two modes with the same τ measured 1.65x and 2.23x); tokens/s = generated tokens / wall seconds of the pass (prefill included, as a user sees it).
Batch b: the domain's prompts in groups of b, one `generate` call per group.

Prefix survival (ReaDy): P̂_j = fraction of fully observable rounds whose first j drafts were all accepted. A
request's last round is cut by max_tokens / a stop token, so it is censored: it counts at position j only when it
accepted ≥ j drafts (an observed survival), never as a rejection.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from hyspec_jax.spec.stats import prefix_survival   # the engine's statistics (SpecStats) use the same

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "heldout_prompts.npz"
MODES = ("ar", "chain", "ready", "tree", "tree-ready", "mtp", "mtp-tree")
DEFAULT_MODES = MODES[:5]   # the MTP modes need a model directory with `mtp.*` tensors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench e2e", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="OUT.json", help="results (a .md report and .png plots next to it)")
    p.add_argument("--model", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: MODEL/drafter)")
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompt pack (.npz: tokens, domain, domains)")
    p.add_argument("--prompts-per-domain", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per configuration (≥ 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default): greedy output is exactly plain decoding's, so equality is checkable; "
                        "bfloat16: each mode's share of ar's tokens reproduced before the first difference")
    p.add_argument("--tree-depth", type=int, default=None, help="tree levels (default: the drafter's γ)")
    p.add_argument("--mtp-steps", type=int, default=None,
                   help="mtp: recursive draft steps of the MTP head (default: the engine's)")
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-beam", type=int, default=6)
    p.add_argument("--verify-nodes", type=int, default=32, help="tree modes: verified nodes per request (N)")
    p.add_argument("--sweep-nodes", type=int, nargs="*", default=[],
                   help="also run tree-ready (or tree) at batch 1 for each N here: the budget curve")
    p.add_argument("--kernels", choices=("reference", "auto"), default="auto",
                   help="tree build (top-k), GDN verify and commit of the speculative modes: the Pallas kernels "
                        "where supported on a GPU (auto, the default; pure JAX elsewhere), or pure JAX everywhere")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.repeats < 1:
        parser.error("--repeats must be at least 1")
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from hyspec_jax.bench.report import portable_command, portable_path, run_metadata
    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.tree import TreeExpansion
    from hyspec_jax.train.distill import load_prompts

    if a.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    dt = jnp.float32 if a.dtype == "float32" else jnp.bfloat16
    model_dir = Path(a.model) if a.model else _default_model()
    drafter_dir = Path(a.drafter) if a.drafter else model_dir / "drafter"
    tokens, domain, names = load_prompts(a.prompts)
    per = {d: [list(map(int, tokens[i])) for i in np.flatnonzero(domain == k)[:a.prompts_per_domain]]
           for k, d in enumerate(names)}
    needs_drafter = any(m not in ("ar", "mtp", "mtp-tree") for m in a.modes) or a.sweep_nodes
    target, drafters = load_models(model_dir, drafter_dir, dt, needs_drafter)
    if any(m in ("mtp", "mtp-tree") for m in a.modes):
        from hyspec_jax.io.mtp_io import load_mtp
        drafters["mtp"] = load_mtp(model_dir, target.config, dtype=dt)
    gamma = drafters[False].config.num_draft_tokens if needs_drafter else (a.tree_depth or 4)
    depth = a.tree_depth or gamma
    params = SamplingParams(max_tokens=a.max_tokens)

    def engine(mode: str, batch: int, nodes: int | None = None):
        return make_engine(target, drafters, mode, batch, kernels=a.kernels,
                           tree=TreeExpansion(depth, a.tree_topk, a.tree_beam), verify_nodes=nodes or a.verify_nodes,
                           mtp_steps=a.mtp_steps)

    def run_pass(eng, batch: int, domains) -> tuple[dict, float]:
        out, secs = {}, {}
        for d in domains:
            ps = per[d]
            t0 = time.perf_counter()
            res = []
            for i in range(0, len(ps), batch):
                res += eng.generate(ps[i:i + batch], params)
            secs[d] = time.perf_counter() - t0
            out[d] = res
        return out, secs

    configs = [(m, b, None) for b in a.batch for m in a.modes]
    sweep_mode = "tree-ready" if drafters.get(True) is not None else "tree"
    configs += [(sweep_mode, 1, n) for n in a.sweep_nodes]
    results: dict = {}
    ref: dict = {}
    out = Path(a.json)
    meta = {**run_metadata(), "command": portable_command("hyspec bench e2e", argv or sys.argv[1:]),
            "model": portable_path(model_dir), "drafter": portable_path(drafter_dir) if needs_drafter else None,
            "dtype": a.dtype, "prompts": portable_path(a.prompts), "prompts_per_domain": a.prompts_per_domain,
            "max_tokens": a.max_tokens, "repeats": a.repeats, "repeat_order": "round-robin over modes",
            "kernels": a.kernels,
            "tree": {"depth": depth, "top_k": a.tree_topk, "beam": a.tree_beam, "verify_nodes": a.verify_nodes}}
    bar = tqdm(total=len(configs) * (1 + a.repeats), desc="bench e2e", unit="pass")
    # Every engine compiles first; then the repeats go round-robin over the configurations, so a drift of the
    # machine's speed over the run (clocks, host load) falls on every mode alike rather than on whichever ran last.
    live: dict = {}                                   # key -> (mode, batch, engine, first pass seconds)
    for mode, batch, nodes in configs:
        key = f"{mode}@b{batch}" + (f"@N{nodes}" if nodes else "")
        eng = engine(mode, batch, nodes)
        if eng is None:
            results[key] = {"skipped": "drafter has no reader"}
            bar.update(1 + a.repeats)
            continue
        t0 = time.perf_counter()
        run_pass(eng, batch, names[:1])                      # compiles
        live[key] = (mode, batch, eng, time.perf_counter() - t0)
        bar.update(1)

    def add_rows(times: dict, outs: dict) -> None:
        """results[key] from the timed passes so far of every live configuration."""
        for key, (mode, batch, eng, compile_s) in live.items():
            row = {"mode": mode, "batch": batch, "verify_nodes": eng.verify_nodes if mode != "ar" else 1,
                   "first_pass_s": round(compile_s, 2), "domains": {}}
            for d in names:
                res = outs[key][d]
                ntok = sum(len(r.token_ids) for r in res)
                tps = [ntok / t for t in times[key][d]]
                toks = [r.token_ids for r in res]
                if mode == "ar":
                    ref[(batch, d)] = toks
                ent = {"tok_s": round(float(np.mean(tps)), 1), "tok_s_std": round(float(np.std(tps)), 1),
                       "tok_s_runs": [round(float(x), 1) for x in tps], "tokens": ntok}
                if mode != "ar":
                    acc = [r.accepted for r in res]
                    committed = [c for r in res for c in r.committed]
                    D = eng.depth
                    ent.update(tau=round(float(np.mean(committed)), 3), rounds=len(committed),
                               accepted_per_position=[round(float(np.mean([x > k for r in acc for x in r])), 4)
                                                      for k in range(D)],
                               prefix_survival=[round(x, 4) for x in prefix_survival(acc, D)])
                # greedy outputs do not depend on the batch (isolation), so any batch's ar run is the reference
                base = ref.get((batch, d)) or next((v for (_, dd), v in ref.items() if dd == d), None)
                ent["equal_ar"] = None if base is None else toks == base
                ent["ar_prefix_share"] = None if base is None else round(ar_prefix_share(toks, base), 4)
                row["domains"][d] = ent
            doms = row["domains"].values()
            row["mean_tok_s"] = round(float(np.mean([e["tok_s"] for e in doms])), 1)
            if mode != "ar":
                row["mean_tau"] = round(float(np.mean([e["tau"] for e in doms])), 3)
            results[key] = row

    times = {key: {d: [] for d in names} for key in live}
    outs: dict = {}
    for _ in range(a.repeats):
        for key, (mode, batch, eng, _) in live.items():
            outs[key], secs = run_pass(eng, batch, names)
            for d in names:
                times[key][d].append(secs[d])
            bar.update(1)
        add_rows(times, outs)
        finish(results, meta, out, partial=True)          # what the repeats so far measured
    bar.close()
    report = finish(results, meta, out, partial=False)
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    if not a.no_plots:
        plots(report, out)
    return 0


def load_models(model_dir: Path, drafter_dir: Path, dtype, with_drafter: bool) -> tuple:
    """(target, {False: DSpark drafter, True: with its ReaDy reader or None for a DSpark-only directory});
    the drafters dict is empty without `with_drafter`."""
    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.io.hf import load_pretrained
    _, target = load_pretrained(model_dir, dtype=dtype)
    drafters = {}
    if with_drafter:
        drafters[False] = load_drafter(drafter_dir, dtype=dtype, with_reader=False)
        try:
            drafters[True] = load_drafter(drafter_dir, dtype=dtype, with_reader=True)
        except Exception:  # noqa: BLE001 - a DSpark-only directory: skip the reader modes
            drafters[True] = None
    return target, drafters


def make_engine(target, drafters: dict, mode: str, batch: int, *, kernels: str, tree, verify_nodes: int,
                mtp_steps: int | None = None):
    """The engine of one benchmarked mode (`tree` / `verify_nodes` used by the tree modes); None for a reader
    mode when the drafter has no reader. The MTP modes draft with `drafters["mtp"]`, the model's own head."""
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    if mode == "ar":
        return Engine(target, None, SpecConfig(mode="ar"), slots=batch)
    if mode == "mtp":
        return Engine(target, drafters["mtp"], SpecConfig(mode=mode, kernels=kernels, chain_length=mtp_steps),
                      slots=batch)
    if mode == "mtp-tree":
        return Engine(target, drafters["mtp"], SpecConfig(mode=mode, kernels=kernels, tree=tree,
                                                              verify_nodes=verify_nodes), slots=batch)
    d = drafters[mode in ("ready", "tree-ready")]
    if d is None:
        return None
    kw = dict(kernels=kernels)
    if mode.startswith("tree"):
        kw.update(tree=tree, verify_nodes=verify_nodes)
    return Engine(target, d, SpecConfig(mode=mode, **kw), slots=batch)


def finish(results: dict, meta: dict, out: Path, partial: bool) -> dict:
    """Speed-ups over ar of the same engine, batch and domain; write the JSON (partial while running)."""
    for row in results.values():
        if "domains" not in row:
            continue
        arrow = results.get(f"ar@b{row['batch']}")
        if arrow and "domains" in arrow:
            for d, e in row["domains"].items():
                e["speedup"] = round(e["tok_s"] / arrow["domains"][d]["tok_s"], 3)
            row["mean_speedup"] = round(float(np.mean([e["speedup"] for e in row["domains"].values()])), 3)
            # paired by repeat: the modes of one repeat ran back to back (round-robin), so the ratio to that
            # repeat's ar cancels a drift of the machine between repeats; its spread is the repeat-to-repeat one
            runs = [(e.get("tok_s_runs"), arrow["domains"][d].get("tok_s_runs")) for d, e in row["domains"].items()]
            if runs and all(m and b and len(m) == len(b) for m, b in runs):
                per_rep = [float(np.mean([m[i] / b[i] for m, b in runs])) for i in range(len(runs[0][0]))]
                row["speedup_paired"] = [round(x, 3) for x in per_rep]
                row["speedup_paired_std"] = round(float(np.std(per_rep)), 3)
    report = {"meta": {**meta, "status": "partial" if partial else "complete"}, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _default_model() -> Path:
    from hyspec_jax.launch import resolve_model_dir
    path, _ = resolve_model_dir(None)
    return Path(path)


def markdown(report: dict) -> str:
    from hyspec_jax.bench.report import short_commit
    m = report["meta"]
    lines = [f"# End-to-end speculative decoding ({m['device_kind']}, {m['dtype']}, greedy)", "",
             f"`{m['command']}` — commit {short_commit(m['commit'])}, jax {m['jax']}; {m['prompts_per_domain']} held-out "
             f"prompts per domain, {m['max_tokens']} new tokens, {m['repeats']} repeats (mean ± std; a speed-up's ± is "
             f"the spread over repeats of its ratio to ar in the same repeat)."
             + (" **The ready modes' reader read the state of another request (one slot up): the swapped-state "
                "control.**" if m.get("reader_state") == "swapped" else ""), ""]
    rows = [r for r in report["results"].values() if "domains" in r]
    domains = list(rows[0]["domains"]) if rows else []
    lines += ["| mode | batch | N | " + " | ".join(domains) + " | mean tok/s | speed-up | τ | == ar |",
              "|---|---|---|" + "---|" * len(domains) + "---|---|---|---|"]
    for r in rows:
        cells = []
        for d in domains:
            e = r["domains"][d]
            cells.append(f"{e['tok_s']:.0f}±{e['tok_s_std']:.0f}" + (f" τ{e['tau']:.2f}" if "tau" in e else ""))
        eq = all(e["equal_ar"] is not False for e in r["domains"].values())
        shares = [e.get("ar_prefix_share") for e in r["domains"].values() if e.get("ar_prefix_share") is not None]
        same = "yes" if eq else "NO" + (f", {100 * float(np.mean(shares)):.0f}% before the first difference"
                                        if shares else "")
        lines.append(f"| {r['mode']} | {r['batch']} | {r['verify_nodes']} | " + " | ".join(cells) +
                     f" | {r['mean_tok_s']:.0f} | {r.get('mean_speedup', 1.0):.2f}x"
                     + (f" (±{r['speedup_paired_std']:.2f} over repeats)" if r.get("speedup_paired_std") is not None else "")
                     + f" | {r.get('mean_tau', 1.0):.2f} | "
                     f"{same} |")
    return "\n".join(lines) + "\n"


def ar_prefix_share(toks: list[list[int]], base: list[list[int]]) -> float:
    """Of the reference's (ar's) tokens, the share the outputs reproduce before each one's first difference: 1.0
    when every output equals ar's (fp32 greedy, lossless); in bf16 how far decoding stays on ar's tokens before a
    rounding flips an argmax."""
    same = total = 0
    for out, ref in zip(toks, base):
        n = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        same, total = same + n, total + len(ref)
    return same / max(total, 1)


def plots(report: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"].values() if "domains" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    main = [r for r in rows if r["mode"] != "ar" and "@N" not in _key(r, report)]
    for r in main:
        surv = np.nanmean([e["prefix_survival"] for e in r["domains"].values()], axis=0)
        axes[0].plot(range(1, len(surv) + 1), surv, marker="o", label=f"{r['mode']} b{r['batch']}")
    axes[0].set(xlabel="draft position j", ylabel="prefix survival P̂_j", title="Prefix survival (censored)",
                ylim=(0, 1))
    axes[0].legend(fontsize=7)
    domains = list(rows[0]["domains"]) if rows else []
    b1 = [r for r in main if r["batch"] == min(x["batch"] for x in main)] if main else []
    w = 0.8 / max(len(b1), 1)
    for i, r in enumerate(b1):
        axes[1].bar(np.arange(len(domains)) + i * w, [r["domains"][d].get("speedup", 0) for d in domains], w,
                    label=r["mode"])
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xticks(np.arange(len(domains)) + w * (len(b1) - 1) / 2, domains, rotation=20)
    axes[1].set(ylabel="speed-up over ar", title=f"Tokens/s over ar, batch {b1[0]['batch'] if b1 else 1}")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    from hyspec_jax.bench.report import save_png
    save_png(fig, out.with_suffix(".png"))
    sweep = [r for r in rows if "@N" in _key(r, report)]
    if sweep:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ns = [r["verify_nodes"] for r in sweep]
        ax.plot(ns, [r["mean_tok_s"] for r in sweep], marker="o", label="tokens/s")
        ax.set(xlabel="verified nodes per request N", ylabel="tokens/s (mean over domains)",
               title=f"Budget curve ({sweep[0]['mode']}, batch 1)", xscale="log", xticks=ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xticks([], minor=True)   # no log-scale minor labels between the swept N
        ax2 = ax.twinx()
        ax2.plot(ns, [r["mean_tau"] for r in sweep], marker="s", color="tab:orange", label="τ")
        ax2.set_ylabel("τ")
        fig.tight_layout()
        from hyspec_jax.bench.report import save_png
        save_png(fig, out.with_name(out.stem + "_budget.png"))


def _key(row: dict, report: dict) -> str:
    return next(k for k, v in report["results"].items() if v is row)


if __name__ == "__main__":
    sys.exit(main())
