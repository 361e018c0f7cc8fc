"""Transient memory of tree verification: Bole's factorized design vs per-node state snapshots (SGLang).

    hyspec bench memory [--model DIR] [--batch B] [--nodes 32,64,128] [--json out.json]

Without --model: the Qwen3.8-27B geometry of docs/reference/target_model.md §15. Pure arithmetic (no device needed);
the counts are checked against real array sizes in tests/test_memory.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hyspec_jax.bench.report import run_metadata
from hyspec_jax.config import TargetConfig
from hyspec_jax.spec.memory import BOLE_TABLE_I, OURS, format_table, memory_table, qwen38_27b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hyspec bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="DIR", help="a model directory (config.json); default Qwen3.8-27B geometry")
    ap.add_argument("--batch", type=int, default=1, help="requests verified together (default 1)")
    ap.add_argument("--nodes", default="32,64,128", help="tree sizes N, comma-separated")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        nodes = tuple(int(n) for n in args.nodes.split(","))
    except ValueError:
        ap.error(f"--nodes must be comma-separated integers, got {args.nodes!r}")
    cfg = TargetConfig.from_pretrained(args.model) if args.model else qwen38_27b()
    name = args.model or "Qwen3.8-27B geometry"
    designs = [("this library", OURS),
               ("keys per value head (an expanded copy)", dataclasses.replace(OURS, shared_keys=False)),
               ("Bole Table I accounting (no conv windows)", BOLE_TABLE_I)]
    out = {"meta": run_metadata(), "model": name, "batch": args.batch, "designs": {}}
    for label, design in designs:
        rows = memory_table(cfg, nodes, args.batch, design)
        print(f"\n{name}, batch {args.batch}, {label}\n{format_table(rows)}")
        out["designs"][label] = [dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0
