"""`hyspec bench ready-control`: the result table of a ReaDy positive-control run
(`train/recipes/ready_control_h200.sh`, `train/recipes/ready_large_h200.sh`) from the files it leaves.

It reads, under the run directory:
- `tau_own.json` (`bench e2e`: DSpark chain and ReaDy with its own state, batch 1 and the swap batch),
  `tau_swapped.json` (ReaDy fed another request's state, the swap batch), `tau_nostate.json` (the state-free LoRA
  control, as chain), optionally `tau_shipped.json` (the shipped drafter's chain and ReaDy);
- `reader/reader_ablation.json` (teacher-forced τ̂ of DSpark and of each stage-1 reader) and the stage-2 /
  no-state runs' `summary.json`.

The comparisons are paired by domain (the engine's τ is a per-domain mean over held-out prompts): the mean of the
per-domain differences ± their standard error over the domains. They answer the issue's questions: does the reader
gain over its DSpark (`ready − chain`), does it gain without the state (`no-state − chain`), does the gain need this
request's state (`own − swapped`, same batch). Every engine row also says whether all its outputs equalled ar's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hyspec_jax.bench.report import publish_report, short_commit


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _row(results: dict, key: str, label: str, source: str) -> dict | None:
    r = results.get(key)
    if r is None:
        return None
    doms = r["domains"]
    taus = {d: e["tau"] for d, e in doms.items() if "tau" in e}
    return {"label": label, "source": f"{source}:{key}", "mode": r["mode"], "batch": r["batch"],
            "tau": round(sum(taus.values()) / len(taus), 4) if taus else 1.0, "tau_by_domain": taus,
            "equal_ar": all(e.get("equal_ar", False) for e in doms.values())}


def paired(a: dict, b: dict) -> dict:
    """a − b over the domains both have: mean, standard error, and the per-domain differences."""
    common = sorted(set(a["tau_by_domain"]) & set(b["tau_by_domain"]))
    diffs = [a["tau_by_domain"][d] - b["tau_by_domain"][d] for d in common]
    n = len(diffs)
    mean = sum(diffs) / n if n else float("nan")
    se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1) / n) if n > 1 else float("nan")
    return {"minus": b["label"], "of": a["label"], "mean": round(mean, 4), "se": round(se, 4), "domains": n,
            "by_domain": {d: round(x, 4) for d, x in zip(common, diffs)}}


def collect(run: Path) -> dict:
    own, swapped = _load(run / "tau_own.json"), _load(run / "tau_swapped.json")
    nostate, shipped = _load(run / "tau_nostate.json"), _load(run / "tau_shipped.json")
    if own is None:
        raise FileNotFoundError(f"{run}/tau_own.json: no such file (the recipe's tau step writes it)")
    rows: dict[str, dict] = {}

    def add(name, data, key, label, source):
        if data is not None and (row := _row(data["results"], key, label, source)) is not None:
            rows[name] = row
    add("chain", own, "chain@b1", "DSpark, chain", "tau_own")
    add("ready", own, "ready@b1", "ReaDy, own state", "tau_own")
    add("nostate", nostate, "chain@b1", "state-free LoRA control, chain", "tau_nostate")
    add("shipped_chain", shipped, "chain@b1", "shipped DSpark, chain", "tau_shipped")
    add("shipped_ready", shipped, "ready@b1", "shipped ReaDy, own state", "tau_shipped")
    swap = next((r["batch"] for r in (swapped or {}).get("results", {}).values() if r["mode"] == "ready"), None)
    if swap is not None:
        add("chain_swap", own, f"chain@b{swap}", f"DSpark, chain, batch {swap}", "tau_own")
        add("ready_own_swap", own, f"ready@b{swap}", f"ReaDy, own state, batch {swap}", "tau_own")
        add("ready_swapped", swapped, f"ready@b{swap}", f"ReaDy, another request's state, batch {swap}",
            "tau_swapped")
    comparisons = {}
    for name, a, b in (("reader_gain", "ready", "chain"), ("state_free_gain", "nostate", "chain"),
                       ("reader_beyond_state_free", "ready", "nostate"),
                       ("state_use", "ready_own_swap", "ready_swapped"),
                       ("reader_gain_swap_batch", "ready_own_swap", "chain_swap"),
                       ("shipped_reader_gain", "shipped_ready", "shipped_chain"),
                       ("new_vs_shipped_chain", "chain", "shipped_chain")):
        if a in rows and b in rows:
            comparisons[name] = paired(rows[a], rows[b])
    teacher = {}
    abl = _load(run / "reader" / "reader_ablation.json")
    if abl is not None:
        teacher["dspark"] = abl["dspark_tau_hat"]
        for k, v in abl["ready1"].items():
            teacher[f"{k} ({v['args']})"] = v["tau_hat"]
    for k in ("ready2", "nostate"):
        s = _load(run / "reader" / k / "summary.json")
        if s is not None and s.get("val"):
            teacher[k] = round(sum(v["tau"] for v in s["val"].values()) / len(s["val"]), 4)
    commands = sorted({(d or {}).get("meta", {}).get("command", "") for d in (own, swapped, nostate, shipped)} - {""})
    return {"rows": rows, "comparisons": comparisons, "teacher_forced_tau_hat": teacher, "e2e_commands": commands,
            "device": own.get("meta", {}).get("device_kind"), "e2e_commit": own.get("meta", {}).get("commit")}


def markdown(rep: dict) -> str:
    meta = rep["meta"]
    doms = sorted({d for r in rep["rows"].values() for d in r["tau_by_domain"]})
    lines = [f"# ReaDy positive control ({rep['device']})", "",
             f"`{meta['command']}` — commit {short_commit(meta.get('commit', '?'))}; the engine runs: commit "
             f"{short_commit(rep.get('e2e_commit') or '?')}, on {rep['device']}.", "",
             "Engine τ (tokens a round, greedy, held-out prompts; per-domain means):", "",
             "| drafter / mode | batch | τ | " + " | ".join(doms) + " | == ar |",
             "|---|---:|---:|" + "---:|" * len(doms) + "---|"]
    for r in rep["rows"].values():
        lines.append(f"| {r['label']} | {r['batch']} | {r['tau']:.3f} | "
                     + " | ".join(f"{r['tau_by_domain'].get(d, float('nan')):.2f}" for d in doms)
                     + f" | {'yes' if r['equal_ar'] else 'NO'} |")
    lines += ["", "Paired differences of τ over the domains (mean ± standard error; n domains):", "",
              "| comparison | a − b | mean ± SE | n |", "|---|---|---:|---:|"]
    for name, c in rep["comparisons"].items():
        lines.append(f"| {name.replace('_', ' ')} | {c['of']} − {c['minus']} | {c['mean']:+.3f} ± {c['se']:.3f} | "
                     f"{c['domains']} |")
    if rep["teacher_forced_tau_hat"]:
        lines += ["", "Teacher-forced τ̂ on the validation windows (the training runs' own evaluation):", "",
                  "| run | τ̂ |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in rep["teacher_forced_tau_hat"].items()]
    if rep["e2e_commands"]:
        lines += ["", "The engine runs:", ""] + [f"    {c}" for c in rep["e2e_commands"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hyspec bench ready-control", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, metavar="DIR", help="the recipe's run directory")
    p.add_argument("--json", metavar="OUT.json", help="write the report here (and OUT.md beside it)")
    args = p.parse_args(argv)
    try:
        rep = collect(Path(args.run))
    except FileNotFoundError as e:
        print(f"hyspec bench ready-control: {e}", file=sys.stderr)
        return 1
    return publish_report(rep, "hyspec bench ready-control", argv, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
