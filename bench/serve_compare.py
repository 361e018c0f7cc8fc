"""`hyspec bench serve-compare`: modes against a baseline from `serve_load` passes, pass by pass.

`serve_load` runs are short (64 requests of 64 tokens take 0.5-5 s a level), and the same server differs from pass
to pass by tens of percent. A ratio is therefore only taken between a mode and the baseline **of the same pass**
(run back to back, as the recipes alternate them), and the table gives each level's median ratio over the passes
with its range, next to the median tok/s of each mode. The width chosen each round (`spec_rounds_by_width`, the
server's `hyspec:spec_rounds_total{width}`) is summed over the passes.

Inputs: `serve_load` JSONs (`--json` of `hyspec_jax.bench.serve_load`). The mode is each result's `mode`, the
dataset its meta's `--dataset`; the pass is the file name's trailing `_N` (the recipes' `serve_load_MODE_DATA_N`),
or, with `--pass-from-dir`, the name of its folder. With `--mode-from-name` the mode is the file name's MODE
instead, so two servers of one spec mode (an A/B of the request loop, say) compare as two modes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from hyspec_jax.bench.report import publish_report, short_commit


class CompareError(ValueError):
    pass


def _pass_of(path: Path, from_dir: bool) -> str:
    if from_dir:
        return path.parent.name
    m = re.search(r"_(\d+)$", path.stem)
    if m is None:
        raise CompareError(f"{path}: no trailing _N in the file name to tell its pass (or use --pass-from-dir)")
    return m.group(1)


def _mode_of_name(path: Path) -> str:
    m = re.fullmatch(r"serve_load_(.+)_[^_]+_[^_]+", path.stem)
    if m is None:
        raise CompareError(f"{path}: not named serve_load_MODE_DATA_N, so --mode-from-name cannot tell its mode")
    return m.group(1)


def collect(paths: list[Path], baseline: str, *, pass_from_dir: bool = False, mode_from_name: bool = False) -> dict:
    # (dataset, concurrency) -> mode -> pass -> result
    cells: dict[tuple[str, int], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    sources = []
    for path in paths:
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CompareError(f"{path}: not a readable serve_load JSON ({e})") from None
        if "results" not in d or "meta" not in d:
            raise CompareError(f"{path}: not a serve_load JSON (no 'meta' and 'results')")
        dataset = d["meta"].get("args", {}).get("dataset", "?")
        pass_id = _pass_of(path, pass_from_dir)
        named = _mode_of_name(path) if mode_from_name else None
        sources.append({"file": path.name, "pass": pass_id, "dataset": dataset,
                        "device": d["meta"].get("device_kind"), "commit": d["meta"].get("commit")})
        for r in d["results"]:
            mode = named or r.get("mode", "?")
            cell = cells[(dataset, int(r["concurrency"]))][mode]
            if pass_id in cell:
                raise CompareError(f"{path}: pass {pass_id} of {mode} / {dataset} / concurrency "
                                   f"{r['concurrency']} given twice")
            cell[pass_id] = r
    if not cells:
        raise CompareError("no serve_load results in the inputs")
    modes = sorted({m for c in cells.values() for m in c} - {baseline})
    if not any(baseline in c for c in cells.values()):
        raise CompareError(f"no results of the baseline mode {baseline!r} (modes given: {', '.join(modes)})")
    rows = []
    for (dataset, conc), by_mode in sorted(cells.items()):
        base = by_mode.get(baseline, {})
        row = {"dataset": dataset, "concurrency": conc,
               baseline: _mode_summary(base)}
        for mode in modes:
            runs = by_mode.get(mode, {})
            s = _mode_summary(runs)
            paired = sorted(set(runs) & set(base), key=_pass_key)
            ratios = [runs[p]["throughput_tok_s"] / base[p]["throughput_tok_s"] for p in paired
                      if base[p]["throughput_tok_s"] > 0]
            s["ratio_by_pass"] = {p: round(x, 3) for p, x in zip(paired, ratios)}
            s["ratio_median"] = round(statistics.median(ratios), 3) if ratios else None
            s["ratio_min"] = round(min(ratios), 3) if ratios else None
            s["ratio_max"] = round(max(ratios), 3) if ratios else None
            widths: dict[str, int] = defaultdict(int)
            for r in runs.values():
                for w, n in (r.get("server", {}).get("spec_rounds_by_width") or {}).items():
                    widths[w] += int(n)
            s["rounds_by_width"] = dict(sorted(widths.items(), key=lambda kv: int(kv[0])))
            row[mode] = s
        rows.append(row)
    return {"baseline": baseline, "modes": modes, "rows": rows, "sources": sources,
            "passes": sorted({s["pass"] for s in sources}, key=_pass_key)}


def _pass_key(p: str):
    return (0, int(p), "") if p.isdigit() else (1, 0, p)


def _shares(runs: dict[str, dict], key: str) -> list[float]:
    """A server counter's seconds over each pass's wall time (passes whose server reports it, above 0)."""
    return [r["server"][key] / r["wall_s"] for r in runs.values()
            if (r.get("server") or {}).get(key) and r.get("wall_s")]


def _mode_summary(runs: dict[str, dict]) -> dict:
    tok = [r["throughput_tok_s"] for r in runs.values()]
    tpot = [r["tpot_s"]["p50"] for r in runs.values() if r.get("tpot_s", {}).get("p50") is not None]
    tau = [r["server"]["spec_tokens_per_round"] for r in runs.values()
           if (r.get("server") or {}).get("spec_tokens_per_round")]
    failed = sum(r["requests"] - r["ok"] for r in runs.values())
    # the share of decoding steps dispatched ahead (pipelined), and of the level's wall time in prefill calls
    # (servers that report them: hyspec:engine_steps_ahead_total, hyspec:engine_prefill_seconds_total)
    ahead = [r["server"]["engine_steps_ahead"] / r["server"]["engine_decode_steps"] for r in runs.values()
             if (r.get("server") or {}).get("engine_steps_ahead") is not None and r["server"].get("engine_decode_steps")]
    prefill = _shares(runs, "engine_prefill_seconds")
    # prefill calls a level: under speculation the requests of a wave end on different rounds, so their successors'
    # prompts arrive apart, each with its own call
    calls = [r["server"]["engine_prefill_calls"] for r in runs.values()
             if (r.get("server") or {}).get("engine_prefill_calls") is not None]
    # the loop's time dispatching decoding steps and waiting to collect them (hyspec:engine_decode_*_seconds):
    # a wait near 0 with dispatch a large share says the host, not the device, sets the period
    dispatch, collect = _shares(runs, "engine_dispatch_seconds"), _shares(runs, "engine_collect_seconds")
    return {"passes": len(runs), "tok_s_median": round(statistics.median(tok), 1) if tok else None,
            "ahead_fraction_median": round(statistics.median(ahead), 3) if ahead else None,
            "prefill_share_median": round(statistics.median(prefill), 3) if prefill else None,
            "prefill_calls_median": statistics.median(calls) if calls else None,
            "dispatch_share_median": round(statistics.median(dispatch), 3) if dispatch else None,
            "collect_share_median": round(statistics.median(collect), 3) if collect else None,
            "tok_s_by_pass": {p: round(r["throughput_tok_s"], 1) for p, r in sorted(runs.items())},
            "tpot_p50_ms_median": round(1e3 * statistics.median(tpot), 3) if tpot else None,
            "tau_median": round(statistics.median(tau), 3) if tau else None, "failed_requests": failed}


def _fmt(x, spec=",.0f"):
    return "—" if x is None else format(x, spec)


def _prefill(summary: dict) -> str:
    share, calls = summary.get("prefill_share_median"), summary.get("prefill_calls_median")
    return _fmt(share, ".0%") + ("" if calls is None else f" ({calls:g})")


def _host(summary: dict) -> str:
    d, c = summary.get("dispatch_share_median"), summary.get("collect_share_median")
    return "—" if d is None and c is None else f"{_fmt(d, '.0%')} · {_fmt(c, '.0%')}"


def markdown(rep: dict) -> str:
    b = rep["baseline"]
    devices = sorted({s["device"] for s in rep["sources"] if s["device"]})
    commits = sorted({short_commit(s["commit"]) for s in rep["sources"] if s["commit"]})
    lines = [f"# serve_load: {', '.join(rep['modes'])} against {b}", "",
             f"`{rep['meta']['command']}` — runs on {', '.join(devices) or '?'}, commit {', '.join(commits) or '?'}; "
             f"{len(rep['passes'])} passes ({', '.join(rep['passes'])}). Ratios are taken within a pass; the "
             "table gives their median and range, and each mode's median output tok/s.", ""]
    for mode in rep["modes"]:
        lines += [f"## {mode} ÷ {b}", "",
                  f"| dataset | concurrency | {b} tok/s | {mode} tok/s | ratio (median) | range | τ | "
                  f"{b} / {mode} TPOT p50 | {b} / {mode} steps pipelined | {b} / {mode} wall in prefill (calls) | "
                  f"{b} / {mode} wall dispatching · collecting | widths chosen (rounds) |",
                  "|---|---:|---:|---:|---:|---|---:|---|---|---|---|---|"]
        for row in rep["rows"]:
            s, base = row.get(mode), row[b]
            if s is None or not s["passes"]:
                continue
            rng = "—" if s["ratio_min"] is None else f"{s['ratio_min']:.2f}–{s['ratio_max']:.2f}x"
            ratio = "—" if s["ratio_median"] is None else f"**{s['ratio_median']:.2f}x**"
            widths = ", ".join(f"{w}: {n}" for w, n in s["rounds_by_width"].items()) or "—"
            lines.append(f"| {row['dataset']} | {row['concurrency']} | {_fmt(base['tok_s_median'])} | "
                         f"{_fmt(s['tok_s_median'])} | {ratio} | {rng} | {_fmt(s['tau_median'], '.2f')} | "
                         f"{_fmt(base['tpot_p50_ms_median'], '.2f')} / {_fmt(s['tpot_p50_ms_median'], '.2f')} ms | "
                         f"{_fmt(base['ahead_fraction_median'], '.0%')} / {_fmt(s['ahead_fraction_median'], '.0%')} | "
                         f"{_prefill(base)} / {_prefill(s)} | "
                         f"{_host(base)} / {_host(s)} | {widths} |")
        lines.append("")
    failed = sum(r[m]["failed_requests"] for r in rep["rows"] for m in [b, *rep["modes"]] if m in r)
    lines.append(f"Failed requests over all passes: {failed}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hyspec bench serve-compare", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, metavar="SERVE_LOAD.json", help="serve_load JSONs (every pass)")
    p.add_argument("--baseline", default="ar", help="the mode every other is divided by (default: ar)")
    p.add_argument("--pass-from-dir", action="store_true",
                   help="the pass is each file's folder name rather than its trailing _N")
    p.add_argument("--mode-from-name", action="store_true",
                   help="the mode is the file name's MODE (serve_load_MODE_DATA_N) rather than the result's own, "
                        "so two servers of one spec mode compare (e.g. serve_load_before_heldout_1.json)")
    p.add_argument("--json", metavar="OUT.json", help="write the report here (and OUT.md beside it)")
    args = p.parse_args(argv)
    try:
        rep = collect(args.files, args.baseline, pass_from_dir=args.pass_from_dir,
                      mode_from_name=args.mode_from_name)
    except CompareError as e:
        print(f"hyspec bench serve-compare: {e}", file=sys.stderr)
        return 1
    return publish_report(rep, "hyspec bench serve-compare", argv, args.json, markdown)


if __name__ == "__main__":
    sys.exit(main())
