"""Budget report (Bole Fig. 11 analogue): end-to-end throughput vs verified nodes per request N, and the node
budget Bole's calibration picks for each ε — from two measurements taken on the same device:

    hyspec bench budget-report --e2e bench/results/archive/e2e_h200.json --table bench/results/budget/calibration_h200.json \
        --json bench/results/budget/budget_h200.json

`--e2e`: a `hyspec bench e2e` run with `--sweep-nodes` (tree-ready or tree at batch 1 for several N; the main
tree row adds its own N). `--table`: a `hyspec calibrate` table for the same model and device (T_ver(N), T_dec).
For each ε in --eps: B_ver(ε) = max{N : T_ver(N) ≤ (1+ε)·T_dec} over the calibrated N (`spec.budget.b_ver`),
and the measured tokens/s at the largest swept N ≤ B_ver(ε). Writes JSON, a markdown table and a PNG.
Nothing is run on a device here: this only joins two recorded measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench budget-report", description=__doc__.split("\n")[0])
    p.add_argument("--e2e", required=True, help="hyspec bench e2e JSON with a node sweep")
    p.add_argument("--table", required=True, help="hyspec calibrate table (same device and model)")
    p.add_argument("--batch", type=int, default=1, help="bucket batch (default 1)")
    p.add_argument("--eps", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0])
    p.add_argument("--json", required=True, metavar="OUT.json")
    return p


def sweep_points(e2e: dict, batch: int) -> tuple[str, dict[int, dict]]:
    """{N: row} of the swept mode at this batch (the sweep rows plus the main row of the same mode)."""
    res = e2e["results"]
    sweep = [r for k, r in res.items() if "@N" in k and r.get("batch") == batch and "domains" in r]
    if not sweep:
        raise ValueError("the e2e results have no node sweep (run hyspec bench e2e with --sweep-nodes)")
    mode = sweep[0]["mode"]
    pts = {r["verify_nodes"]: r for r in sweep}
    main = res.get(f"{mode}@b{batch}")
    if main and "domains" in main:
        pts.setdefault(main["verify_nodes"], main)
    return mode, dict(sorted(pts.items()))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from hyspec_jax.bench.report import portable_command
    from hyspec_jax.spec.budget import b_ver

    e2e = json.loads(Path(a.e2e).read_text())
    table = json.loads(Path(a.table).read_text())
    device = e2e["meta"]["device_kind"]
    entries = [e for e in table["entries"].values() if e["batch"] == a.batch and e["device_kind"] == device]
    if not entries:
        raise ValueError(f"{a.table}: no entry for batch {a.batch} on {device}")
    entry = entries[0]
    t_ver = {int(n): float(t) for n, t in entry["t_ver_ms"].items()}
    t_dec = float(entry["t_dec_ms"])
    mode, pts = sweep_points(e2e, a.batch)
    rows = []
    for eps in a.eps:
        n, within = b_ver(t_ver, t_dec, eps)
        usable = [m for m in pts if m <= n]
        pick = max(usable) if usable else min(pts)
        rows.append({"eps": eps, "b_ver": n, "within": within, "measured_n": pick,
                     "tok_s": pts[pick]["mean_tok_s"], "tau": pts[pick].get("mean_tau")})
    curve = [{"n": n, "tok_s": r["mean_tok_s"], "tau": r.get("mean_tau"),
              "t_ver_over_t_dec": round(t_ver[n] / t_dec, 3) if n in t_ver else None} for n, r in pts.items()]
    best = max(curve, key=lambda c: c["tok_s"])
    out = {"meta": {"e2e": a.e2e, "table": a.table, "device_kind": device, "mode": mode, "batch": a.batch,
                    "t_dec_ms": t_dec, "table_dtype": entry.get("dtype"), "table_depth": entry.get("max_depth"),
                    "e2e_dtype": e2e["meta"].get("dtype"), "command": portable_command("hyspec bench budget-report", argv or sys.argv[1:])},
           "curve": curve, "eps": rows, "best_measured_n": best["n"]}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    md = [f"# Budget: {mode} at batch {a.batch} on {device}", "",
          f"e2e in {e2e['meta'].get('dtype')}; calibration table in {entry.get('dtype')} with a depth-"
          f"{entry.get('max_depth')} template (T_ver ratios are the table's).", "",
          "| N | tok/s | τ | T_ver(N)/T_dec |", "|---|---|---|---|"]
    md += [f"| {c['n']} | {c['tok_s']:.0f} | {c['tau']:.2f} | {c['t_ver_over_t_dec'] if c['t_ver_over_t_dec'] else '—'} |"
           for c in curve]
    md += ["", "| ε | B_ver(ε) | N used (largest swept ≤ B_ver) | tok/s |", "|---|---|---|---|"]
    md += [f"| {r['eps']} | {r['b_ver']}{'' if r['within'] else ' (none within ε)'} | {r['measured_n']} | "
           f"{r['tok_s']:.0f} |" for r in rows]
    text = "\n".join(md) + "\n"
    path.with_suffix(".md").write_text(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [c["n"] for c in curve]
    ax.plot(ns, [c["tok_s"] for c in curve], marker="o", label=f"{mode} tokens/s (measured)")
    cal = next((r for r in rows if r["eps"] == 0.1), rows[0])
    ax.axvline(cal["b_ver"], color="tab:red", ls="--", label=f"calibrated B_ver (ε={cal['eps']}) = {cal['b_ver']}")
    ax.set(xscale="log", xlabel="verified nodes per request N", ylabel="tokens/s",
           title=f"Throughput vs node budget ({device}, batch {a.batch})")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xticks([], minor=True)   # no log-scale minor labels ("3×10⁰") between the swept N
    ax.legend(fontsize=8)
    fig.tight_layout()
    from hyspec_jax.bench.report import save_png
    save_png(fig, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
