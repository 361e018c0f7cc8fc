"""One-shot `hyspec generate`: what a user who runs one command per prompt gets, per mode (`hyspec bench oneshot`).

Every trial is a fresh process — `python -m hyspec_jax.cli generate --json PROMPT` — so it pays what a one-shot call
pays: imports, loading the weights (and the drafter), loading every program it runs (from the program and
compilation caches, which one untimed call per checkout and mode fills first), the prefill and the decode. Two
times per trial:

- **call**: the generation itself (`stats.seconds` of `--json`: from the first prefill to the last token, program
  loads included) — the "tok/s incl. compile" that `hyspec generate` prints; of it, the prefill (with its
  program's load);
- **process**: the whole command, imports and weight loading included (the same in every mode but the drafter's).

Modes, sizes and checkouts alternate inside every repeat (prompt by prompt), so a machine's drift hits all alike.
Prompts: held-out validation windows (`bench/data/heldout_prompts.npz`), decoded to text. `default` is the command
without `--spec-mode` (what the model's `recommended_modes.json` picks for that call; the *ran* column says which
mode ran); a named mode is passed as `--spec-mode`, its other options left to the recommendation. Several
`--max-tokens` sizes give one row per size and a break-even line: the smallest size at which each mode's call and
whole command are no slower than the first mode's (where a `min_new_tokens` comes from). `--base DIR` adds another
checkout (its own `hyspec_jax` first on the path), e.g. the tree before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench oneshot", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", nargs="+", default=["ar", "default"],
                   help="modes to compare ('default': no --spec-mode; the first is the baseline; default: ar default)")
    p.add_argument("--prompts-per-domain", type=int, default=2, help="held-out prompts per domain (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="passes over the prompts (default 3)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[64], metavar="N",
                   help="new tokens per call; several sizes alternate (default 64)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--base", nargs="*", default=[], metavar="DIR", help="other checkouts to run side by side")
    p.add_argument("--json", default=None, help="write the results here (and a .md table beside it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def heldout_texts(per_domain: int) -> list[tuple[str, str]]:
    """(domain, text) of the first `per_domain` held-out windows of every domain (token ids of the embedded model,
    decoded with its tokenizer: any model re-encodes the text)."""
    import numpy as np

    from hyspec_jax.embedded import default_model_dir
    from hyspec_jax.tokenizer import load_tokenizer
    if default_model_dir() is None:
        raise ValueError("the held-out prompts need the embedded model's tokenizer, and none is installed")
    data = np.load(HERE / "data" / "heldout_prompts.npz")
    tok = load_tokenizer(default_model_dir())
    out = []
    for d, name in enumerate(data["domains"]):
        rows = np.flatnonzero(data["domain"] == d)[:per_domain]
        out += [(str(name), tok.decode(data["tokens"][r].tolist())) for r in rows]
    return out


def trial(root: Path, mode: str, prompt: str, a: argparse.Namespace, max_tokens: int) -> dict:
    """One fresh `generate` process of checkout `root`: call and process seconds, new tokens, the mode that ran."""
    cmd = [sys.executable, "-m", "hyspec_jax.cli", "generate", "--json", "--max-tokens", str(max_tokens)]
    cmd += ["--spec-mode", mode] if mode != "default" else []
    cmd += ["--model", a.model] if a.model else []
    env = dict(os.environ, PYTHONPATH=str(root))
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--", prompt], cwd=root, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise RuntimeError(f"{root.name} {mode}: {last}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    st = res["stats"]
    return {"call_s": st["seconds"], "prefill_s": st["prefill_seconds"], "process_s": wall,
            "tokens": st["new_tokens"], "mode": st.get("mode", mode), "verify_nodes": st.get("verify_nodes", 1)}


def summarize(trials: list[dict]) -> dict:
    """Pooled rates (total tokens / total seconds) and the median per-call times."""
    tokens = sum(t["tokens"] for t in trials)
    call, proc = sum(t["call_s"] for t in trials), sum(t["process_s"] for t in trials)
    return {"trials": len(trials), "tokens": tokens, "call_tok_s": round(tokens / call, 2),
            "process_tok_s": round(tokens / proc, 2),
            "median_call_s": round(statistics.median(t["call_s"] for t in trials), 4),
            "median_prefill_s": round(statistics.median(t["prefill_s"] for t in trials), 4),
            "median_process_s": round(statistics.median(t["process_s"] for t in trials), 4),
            "ran_mode": sorted({t["mode"] if t["mode"] == "ar" else f"{t['mode']} N={t['verify_nodes']}"
                                for t in trials})}


def break_even(r: dict) -> dict:
    """Per checkout and mode after the first: the smallest --max-tokens at which both its pooled call and whole-
    command rates are >= the first mode's, or None where no measured size is (sizes ascending)."""
    out = {}
    for c in r["checkouts"]:
        for m in r["modes"][1:]:
            key = f"{c['label']}: {m}"
            out.setdefault(key, None)
            base, s = c["modes"][r["modes"][0]], c["modes"][m]
            if out[key] is None and s["call_tok_s"] >= base["call_tok_s"] and \
                    s["process_tok_s"] >= base["process_tok_s"]:
                out[key] = c["max_tokens"]
    return out


def markdown(r: dict) -> str:
    from hyspec_jax.bench.report import short_commit
    sizes = " / ".join(str(n) for n in r["max_tokens"])
    lines = [f"# One-shot `hyspec generate`, {sizes} new tokens per call", "",
             f"`{r['command']}` — commit {short_commit(r['commit'])}, {r['device_kind']}, jax {r['jax']}, "
             f"{r['time_utc']}", "",
             f"{r['prompts']} held-out prompts × {r['repeats']} repeats per row, each a fresh process (caches filled "
             "by one untimed call first). *call*: the generation (prefill + decode, program loads included); "
             "*process*: the whole command. *ran*: the mode the call ran (N: verified nodes). Ratios against the "
             "first mode of the same checkout and size.", "",
             "| checkout | max tokens | mode | ran | tokens | call tok/s | ratio | median call s | of it prefill s | "
             "process tok/s | ratio | median process s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["checkouts"]:
        base = c["modes"][r["modes"][0]]
        for m in r["modes"]:
            s = c["modes"][m]
            lines.append(f"| {c['label']} | {c['max_tokens']} | {m} | {', '.join(s['ran_mode'])} | {s['tokens']} | "
                         f"{s['call_tok_s']:.1f} | "
                         f"{s['call_tok_s'] / base['call_tok_s']:.2f}x | {s['median_call_s']:.3f} | "
                         f"{s['median_prefill_s']:.3f} | "
                         f"{s['process_tok_s']:.1f} | {s['process_tok_s'] / base['process_tok_s']:.2f}x | "
                         f"{s['median_process_s']:.3f} |")
    if len(r["max_tokens"]) > 1:
        lines += ["", f"Break-even against {r['modes'][0]} (smallest size with call and process ratios >= 1): "
                  + "; ".join(f"{k} {'none measured' if v is None else v}" for k, v in r["break_even"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.prompts_per_domain, a.repeats, *a.max_tokens) < 1:
        print("error: --prompts-per-domain, --repeats and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    sizes = sorted(set(a.max_tokens))
    import hyspec_jax
    roots = [Path(hyspec_jax.__file__).resolve().parent.parent] + [Path(b).resolve() for b in a.base]
    for r in roots[1:]:
        if not (r / "hyspec_jax" / "__init__.py").is_file():
            print(f"error: {r} is not a checkout (no hyspec_jax/)", file=sys.stderr)
            return 2
    from tqdm import tqdm
    try:
        prompts = heldout_texts(a.prompts_per_domain)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cells = [(i, n, m) for i in range(len(roots)) for n in sizes for m in a.modes]
    runs = {c: [] for c in cells}
    bar = tqdm(total=len(cells) + len(runs) * a.repeats * len(prompts), desc="oneshot", unit="call",
               disable=a.no_progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for i, n, m in cells:       # fill the caches: the first call of a mode and size exports / compiles
            trial(roots[i], m, prompts[0][1], a, n)
            bar.update(1)
        for _ in range(a.repeats):
            for _, text in prompts:
                for i, n, m in cells:
                    runs[i, n, m].append(trial(roots[i], m, text, a, n))
                    bar.update(1)
    except (RuntimeError, OSError, json.JSONDecodeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    from hyspec_jax.bench.report import portable_command, portable_path, run_metadata, write_report
    report = {**run_metadata(), "command": portable_command("hyspec bench oneshot", argv or sys.argv[1:]),
              "modes": a.modes, "max_tokens": sizes, "repeats": a.repeats, "prompts": len(prompts),
              "model": portable_path(a.model),
              "checkouts": [{"label": "this checkout" if i == 0 else f"--base {root.name}", "max_tokens": n,
                             "modes": {m: {**summarize(runs[i, n, m]), "runs": runs[i, n, m]} for m in a.modes}}
                            for i, root in enumerate(roots) for n in sizes]}
    report["break_even"] = break_even(report)
    write_report(report, a.json, markdown)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
