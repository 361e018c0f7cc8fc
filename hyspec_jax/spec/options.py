"""Speculative-decoding command-line options (one home for `hyspec generate` and `hyspec serve`) and the
embedded drafter's recommended settings. No jax import here: `hyspec --help` stays fast."""

from __future__ import annotations

MODES = ("ar", "chain", "ready", "tree", "tree-ready", "mtp", "mtp-tree")
TREE_MODES = ("tree", "tree-ready", "mtp-tree")   # a draft tree verified by Bole's solve (tree options apply)
MTP_MODES = ("mtp", "mtp-tree")     # drafted by the target checkpoint's own MTP head (no --drafter)
MTP_DEFAULT_STEPS = 2               # mtp: recursive draft steps when --chain-length is not given (a default, unmeasured)
KERNEL_IMPLS = ("reference", "auto", "pallas", "interpret")   # hyspec_jax.kernels impl of tree top-k, verify, commit

RECOMMENDED_FILE = "recommended_modes.json"


def add_spec_arguments(p, *, default_mode: str | None = None) -> None:
    """The speculative-decoding options of `hyspec generate` and `hyspec serve` (one home)."""
    p.add_argument("--drafter", metavar="DIR", help="DSpark drafter directory (DeepSpec layout; reader/ for ReaDy; "
                   "default with the embedded model: its drafter)")
    p.add_argument("--spec-mode", choices=MODES, default=default_mode,
                   help="ar = plain decoding; chain = DSpark; ready = DSpark + reader; tree = DSpark tree with Bole "
                        "verification; tree-ready = both; mtp = the model's own multi-token-prediction head "
                        "(mtp.* tensors), a chain of --chain-length recursive steps; mtp-tree = that head expanded "
                        "as a tree (--tree-depth/--tree-topk/--tree-beam) (default: " + (
                            default_mode or "the embedded model's measured best mode for this backend "
                            "(drafter/recommended_modes.json), ar outside its measured bounds (max_slots requests, "
                            "min_new_tokens per call); chain with another --drafter; else ar") + ")")
    p.add_argument("--chain-length", type=int, metavar="K", help="drafts per chain (default: the drafter's block; "
                   f"mtp: {MTP_DEFAULT_STEPS} recursive steps)")
    p.add_argument("--confidence-threshold", type=float, metavar="A",
                   help="chain: verify the drafts whose confidence survival is >= A (DSpark)")
    p.add_argument("--tree-depth", type=int, metavar="D", help="tree levels (default: recommended, else 4)")
    p.add_argument("--tree-topk", type=int, metavar="K", help="children per tree node (default: recommended, else 2)")
    p.add_argument("--tree-beam", type=int, metavar="W", help="tree nodes kept per level (default: recommended, "
                   "else 4)")
    p.add_argument("--verify-nodes", type=int, metavar="N", help="verified nodes per request, anchor included "
                   "(default: recommended, else --budget-table's B_ver, else chain length + 1 / min(tree nodes, 16))")
    p.add_argument("--budget", type=int, metavar="C", help="batch-wide node budget (default: N x batch slots); "
                   "below that, the verify runs on the selected nodes packed into C rows (Bole's packed forest)")
    p.add_argument("--budget-table", metavar="FILE", help="calibration table from `hyspec calibrate` (B_ver per "
                   "bucket; where it holds this engine's round times, the verify width is chosen every round, "
                   "from plain decoding to --verify-nodes; default with the embedded model: its own table)")
    p.add_argument("--packed-widths", action="store_true", default=None,
                   help="with a calibrated table: the per-round choice picks a batch-wide node budget (slots x 1, 2, "
                        "4, .. N) verified packed into that many rows (Bole's packed forest), instead of a width of "
                        "nodes per request")
    p.add_argument("--width-margin", type=float, metavar="F",
                   help="with a calibrated table: a verify width whose round costs less than F (a fraction) below a "
                        "wider width's is not compiled, the wider one runs instead: at most F slower per round, fewer "
                        "programs to compile at start-up (default 0.05; 0 compiles every width that can win; plain "
                        "decoding is always kept where it can win)")
    p.add_argument("--deferred-rows", type=int, metavar="P", default=0,
                   help="deferred GDN commit: keep each request's accepted rows (P per GDN layer, at least a "
                        "round's depth + 1) beside a checkpoint state and write the state only when they run out, "
                        "instead of every round (default 0: write every round)")
    p.add_argument("--kernels", choices=KERNEL_IMPLS[:2], default="auto",
                   help="tree build, GDN tree verification and commit: auto (default) = the Pallas top-k, "
                        "tree-solve, tree-attention and path-commit kernels on an NVIDIA GPU where the shape is "
                        "supported, the pure-JAX path otherwise (so on a CPU); reference = pure JAX (XLA) "
                        "everywhere. On the H200, auto is the faster: bench/results/archive/e2e_h200_auto.md")


def recommended_settings(drafter_dir, backend: str) -> dict:
    """The measured best speculative settings of a drafter for a backend ('cpu' / 'gpu'): its
    recommended_modes.json (written from `hyspec bench e2e` results), or {}. Two optional bounds of where the
    mode was measured faster than plain decoding (`plain_decoding_reason`): "max_slots", the most concurrent
    requests; "min_new_tokens", the fewest new tokens one `hyspec generate` call must ask for (measured once,
    bench/results/e2e/oneshot_cpu_breakeven.md: below it, loading the mode's extra programs and drafter costs more
    than decoding saves);
    "serve_max_slots", the most slots of a `hyspec serve` measured faster through the server (its rounds run in
    decoding buckets: `Backend.step_rows`), where it differs from the end-to-end runs' max_slots."""
    import json
    from pathlib import Path

    path = Path(drafter_dir) / RECOMMENDED_FILE
    if not path.is_file():
        return {}
    rec = json.loads(path.read_text()).get(backend) or {}
    return {k: rec[k] for k in ("spec_mode", "tree_depth", "tree_topk", "tree_beam", "verify_nodes",
                                "chain_length", "max_slots", "min_new_tokens", "serve_max_slots")
            if rec.get(k) is not None}


def plain_decoding_reason(rec: dict, slots: int | None = None, new_tokens: int | None = None,
                          server: bool = False) -> str | None:
    """Why a default (no --spec-mode) run decodes plainly instead of taking the recommendation `rec`
    (`recommended_settings`), or None when the recommendation applies. slots: concurrent requests (None: not
    bounded); new_tokens: new tokens asked for in the whole call, max_tokens x prompts (None: a server, whose
    start-up is not paid per request); server: a `hyspec serve`, bounded by serve_max_slots where given."""
    if not rec:
        return "no speculative mode measured faster on this backend"
    key = "serve_max_slots" if server and rec.get("serve_max_slots") is not None else "max_slots"
    if rec.get(key) is not None and slots is not None and slots > rec[key]:
        return f"{slots} concurrent requests > {key} {rec[key]} of the recommendation"
    if rec.get("min_new_tokens") is not None and new_tokens is not None and new_tokens < rec["min_new_tokens"]:
        return (f"{new_tokens} new tokens < min_new_tokens {rec['min_new_tokens']}: loading "
                f"{rec['spec_mode']}'s programs and drafter would cost more than speculation saves")
    return None
