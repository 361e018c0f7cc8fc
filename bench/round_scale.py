"""One speculative round at scale (issue #48, item 5): the engine's round against a decoding step at the
Qwen3.8-27B geometry, for each drafting mode, and the speed-up that PROJECTS.

    hyspec bench round-scale [--mode tree-ready | --mode chain,tree-ready,mtp,mtp-tree] [--batch 1,8,32]
                             [--nodes 8,32] [--prefix 512] [--tree-depth 7] [--tree-topk 8] [--tree-beam 16]
                             [--max-seconds S] [--json OUT.json] [--tiny | --config PATH] ...
    hyspec bench round-scale --merge A.json B.json --json OUT.json
    python -m hyspec_jax.bench.round_scale ...        (same options)

Modes (`spec.options.MODES` less ar; --mode takes one or a comma list, run in one process beside one decoding
step per batch): `chain`, `ready` (+ ReaDy's reader), `tree`, `tree-ready` (the default) draft with the DSpark
drafter below; `mtp` (a chain of recursive steps) and `mtp-tree` (that head expanded as a tree) with the target's
own MTP head, no separate drafter. The tree options (--tree-*) apply to the tree modes.

Models, RANDOM weights created on the device leaf by leaf as `hyspec bench verify-scale` creates them
(`bench/verify_scale.py`: `random_params`, `random_state`, `fill_leaf`; the drafter and the MTP head by the same
fillers):

  target   the Qwen3.8-27B geometry (`spec.memory.qwen38_27b`; or --config PATH / --tiny);
  drafter  (DSpark modes) the published geometry of a DSpark/DFlash drafter for a 64-layer 27B-class target
           (docs/reference/drafters.md §5.2): hidden = the target's (5120), 5 layers, 32 query heads, 8 KV
           heads, head_dim 128, intermediate 17408, vocabulary = the target's (248320), taps [1, 16, 31, 46, 61]
           (the z-lab / SGLang rule, `config.default_target_layer_ids`); block size γ = 7, the setting of ReaDy's
           Qwen3.8-27B results (arXiv 2610.20503, Table 1; its drafter starts from RadixArk/Qwen3.8-27B-DSpark,
           whose own block size is unpublished — drafters.md §9); DeepSpec's heads (the `DrafterConfig`
           defaults: a vanilla Markov head of rank 256, a confidence head); with a reader mode (`ready`,
           `tree-ready`), ReaDy's rank-8 reader of GDN layers 30 and 62 (`ReaderConfig.for_target`; the other
           modes run the same drafter without it, as the engine does). --draft-layers, --block-size and --taps
           override those numbers; --drafter-config PATH takes a whole drafter config.json instead.
  MTP head (mtp modes) Qwen's published layout (docs/reference/target_model.md §8, drafters.md §10;
           `models.mtp.MTPHead`): one full-attention decoder layer of the target's kind at the target's hidden
           size (5120; 24 q / 4 kv heads of 256, intermediate 17408), fc [2H -> H], three zero-centred norms, the
           target's embedding and LM head (a --config that declares more MTP layers gets its own count); its cache
           (`models.mtp.MTPState`) random like the drafter's context.

Verify width N (--nodes; anchor included): a tree mode verifies N of its tree's nodes (default 8, 32); a chain
mode's N is its node count — N − 1 drafts and the anchor (`SpecConfig(chain_length=N − 1, verify_nodes=N)`, the
width `Engine` gives a chain), 2 ≤ N ≤ γ + 1 for a DSpark chain (default 6 and γ + 1: DSpark v2's published
5 drafts and the full block), N ≥ 2 recursive-step chains for mtp (default 4: three steps, the published τ 3.28).

Programs, per batch B (slots), mode and verify width N, every slot holding a committed prefix of --prefix tokens
(random but deterministic target state, drafter context K/V and MTP cache; KV length S = --max-len, default
prefix + max(every N, the rounds' overshoot: depth + 2)):

  T_round(B, N)   the engine's round: the backend `Engine(target, drafter or MTP head, SpecConfig(mode, tree or
                  chain length, N)).backend(B, S)` builds for the bucket, its program
                  `runtime.programs.spec_round_io_jit`
                  with the backend's greedy round shape (draft, select, verify, accept, commit; target and drafter
                  context or MTP cache donated), called as `SpecBackend.dispatch` / `collect` call it (host inputs
                  packed, the host output read back);
  T_draft(B, N)   the round's draft phase alone (`spec.round.round_draft_jit`: drafter forward, tree, selection);
  T_verify(B, N)  its verify phase alone (`spec.round.round_verify_jit` over the forest the draft selected);
  T_dec(B)        the request loop's plain decoding step (`runtime.programs.ar_step_jit`, as `ARBackend.dispatch`
                  / `collect` call it; state donated).

Every program is lowered (batch 1 first; the rounds and decoding steps before the phases alone) and then compiled
ahead of time in parallel threads (`verify_scale.compile_all`), then called through its compiled executable —
--warmup untimed calls, then the median of --repeats calls, each waited for (`calibrate.median_time`). A donated
state is fed back with its committed lengths restored before each call (untimed), so every call starts from the
same prefix. With random weights the drafts are almost never accepted: a round's cost does not depend on that
(every shape is static), but the JSON records the accepted drafts per round so nobody reads a τ into it.

PROJECTIONS, not measurements: speed-up = τ · T_dec / T_round (`projected_speedup`: a round commits τ tokens per
request on average where a decoding step commits one), at

  published τ  each mode's published number on Qwen3.8-27B, where one is recorded (`PUBLISHED_TAUS`; never a guess):
               tree, tree-ready: ReaDy's mean 4.53 (arXiv 2610.20503, Table 1: 4.5285 over seven benchmarks, greedy,
               block size 7, one B200 — the τ of its own drafting, not of this tree) at every N; ready: the same at
               N 8 (its 7 drafts); chain: DSpark v2's 3.73 with 5 drafts (N 6); mtp: Qwen3.8-27B's own MTP head,
               1.90 / 2.68 / 3.28 / 3.79 with 1 / 2 / 3 / 4 drafts (N 2 / 3 / 4 / 5; one H200, thinking off) — the
               last two as docs/reference/drafters.md §10 records them, beside SGLang's 5.61 ms per output token
               with that head; mtp-tree: none. --published-tau T instead: T for every mode and N;
  τ_emb        the embedded model's τ measured by `hyspec bench e2e` for the same mode, tree and N (--tau-from,
               default bench/results/e2e/e2e_h100_loop.json: tree-ready, tree depth 7 / top-k 8 / beam 16, N 32,
               τ 3.48 on held-out prompts); a mode or N that file did not measure has no such projection.

Each row says whether a projection reaches --target (default 1.8×: the issue's target at B = 1..32).

Outputs (with --json OUT.json): OUT.json (run_metadata: device, versions, commit; the command; the modes; the
target's, the drafter's and/or the MTP head's geometry and parameter count; every time, each row with its mode;
the τ used and where it came from) and OUT.md, rewritten after every measured program ("status": "partial", and
"skipped", when --max-seconds left programs out). `--merge A.json B.json --json OUT.json` combines runs of other
batches, N or modes (no device; runs of different modes only at the same KV length, --max-len, so that their T_dec
is one program's).

One H200 (kind nvidia-h200, run with timeout_s 600), from the repository root (bench/verify_scale.py's convention;
.jax_cache is git-ignored, so a warm machine keeps the compiles between calls). The programs run 64 unrolled layers
(a round compiles about as long as a verify, 16–45 s each at this geometry: bench/results/README.md), and every
program is compiled before any is timed, so the rounds and decoding steps come first (9 programs), then, on the
warm machine, the whole set (the 9 from the cache, 12 phase programs new):

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.round_scale --no-phases --compile-workers 2 --max-seconds 240 \\
        --compile-cache .jax_cache --no-progress --json $OUT/round_scale_h200_rounds.json
    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.round_scale --compile-workers 2 --max-seconds 240 \\
        --compile-cache .jax_cache --no-progress --json $OUT/round_scale_h200.json

If a call left programs out (listed as skipped), run them in a further call on the warm machine (e.g. `--batch 32
--json $OUT/round_scale_h200_b32.json`), then, here, `--merge A.json B.json --json
bench/results/scale/round_scale_h200.json` (a later file's rows win). Every mode at batch 1 beside one decoding
step (8 programs: chain N 6 / 8, tree-ready N 8 / 32, mtp N 4, mtp-tree N 8 / 32, the step), then the further
batches in further calls:

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.round_scale --mode chain,tree-ready,mtp,mtp-tree --batch 1 --max-len 544 --no-phases \\
        --compile-workers 2 --max-seconds 300 --compile-cache .jax_cache --no-progress \\
        --json $OUT/round_scale_modes_b1.json

CPU smoke run: `--tiny`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from hyspec_jax.runtime.calibrate import _ints, median_time
from hyspec_jax.bench.verify_scale import (_count, _gib, _ms, _xla_stats, add_geometry_arguments, drive,
                                           add_run_arguments, compile_all, fill_leaf, make_mesh, progress_bar,
                                           random_params, random_state, settle_merged)

DEFAULT_BATCH, DEFAULT_NODES = (1, 8, 32), (8, 32)
DEFAULT_TREE = (7, 8, 16)             # depth, top-k, beam: bench/recipes/lib.sh WIDE_TREE (the GPU default)
# The engine's speculative modes (`spec.options.MODES` less ar): a DSpark drafter's (chain, ready, tree,
# tree-ready) and the target's own MTP head's (mtp, mtp-tree); the first is the default
MODES = ("tree-ready", "tree", "chain", "ready", "mtp", "mtp-tree")
DEFAULT_CHAIN_NODES = (6,)            # chain / ready: 5 drafts (DSpark v2's published τ), and γ + 1 (the full block)
DEFAULT_MTP_NODES = (4,)              # mtp: 3 recursive steps (the MTP head's published τ 3.28)
# The published drafter geometry for a 64-layer 27B-class target (docs/reference/drafters.md §5.2); hidden size and
# vocabulary are the target's (`DrafterConfig.from_target`), the taps its default rule.
PUBLISHED_DRAFTER = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=17408)
PUBLISHED_LAYERS = 5
PUBLISHED_BLOCK = 7                   # ReaDy's Qwen3.8-27B results (arXiv 2610.20503, Table 1)
DRAFTER_SOURCE = ("docs/reference/drafters.md §5.2 (64-layer 27B-class target: hidden 5120, 5 layers, 32 q / 8 kv "
                  "heads, head_dim 128, intermediate 17408, vocab 248320, taps [1,16,31,46,61]); block size 7 as "
                  "ReaDy's Qwen3.8-27B results (arXiv 2610.20503, Table 1); DeepSpec heads (Markov rank 256, "
                  "confidence head)")
PUBLISHED_TAU = 4.5285                # ReaDy, Qwen3.8-27B, mean of seven benchmarks (arXiv 2610.20503, Table 1)
PUBLISHED_TAU_SOURCE = ("ReaDy (arXiv 2610.20503) Table 1: mean τ 4.5285 on Qwen3.8-27B over seven benchmarks, "
                        "greedy, block size 7, one B200")
# Published τ on Qwen3.8-27B per mode (docs/reference/drafters.md §10, "Published acceptance"): (label, source,
# τ) with τ one number for every N (the tree modes: ReaDy's own drafting, not the tree measured), or {drafts: τ}
# for a chain of N − 1 drafts; a mode or N without one has no published projection (never a guess).
DSPARK_TAU_SOURCE = ("docs/reference/drafters.md §10: DSpark v2 for Qwen3.8-27B, τ 3.73 with 5 drafts (its drafter's "
                     "geometry is not published beside it)")
MTP_TAU_SOURCE = ("docs/reference/drafters.md §10: Qwen3.8-27B's own MTP head, one H200, thinking off, τ 1.90 / 2.68 "
                  "/ 3.28 / 3.79 with 1 / 2 / 3 / 4 drafts")
PUBLISHED_TAUS = {
    "tree-ready": ("ReaDy", PUBLISHED_TAU_SOURCE, PUBLISHED_TAU),
    "tree": ("ReaDy", PUBLISHED_TAU_SOURCE, PUBLISHED_TAU),
    "ready": ("ReaDy", PUBLISHED_TAU_SOURCE, {PUBLISHED_BLOCK: PUBLISHED_TAU}),
    "chain": ("DSpark v2", DSPARK_TAU_SOURCE, {5: 3.73}),
    "mtp": ("Qwen3.8-27B MTP head", MTP_TAU_SOURCE, {1: 1.90, 2: 2.68, 3: 3.28, 4: 3.79}),
}
# Qwen's published MTP layout (docs/reference/target_model.md §8, drafters.md §10): one full-attention decoder
# layer of the target's kind at the target's hidden size, fc [2H -> H], three zero-centred norms; embedding and LM
# head are the target's
MTP_LAYERS = 1
MTP_SOURCE = ("Qwen's published layout (docs/reference/target_model.md §8, docs/reference/drafters.md §10): "
              "mtp_num_hidden_layers 1, a full-attention decoder layer of the target's kind at its hidden size, "
              "fc [2H -> H], the target's embedding and LM head")
DEFAULT_TAU_FILE = Path(__file__).resolve().parent / "results" / "e2e" / "e2e_h100_loop.json"
TARGET = 1.8
DRAFTER_STREAM, DSTATE_STREAM = 1 << 20, 1 << 21     # fill_leaf streams apart from the target's (0, 1 + B)
MTP_STREAM, MSTATE_STREAM = 1 << 22, 1 << 23


def is_chain(mode: str) -> bool:
    """A chain mode (chain, ready, mtp): its round verifies N = drafts + 1 nodes."""
    from hyspec_jax.spec.options import TREE_MODES
    return mode not in TREE_MODES


def uses_mtp(mode: str) -> bool:
    from hyspec_jax.spec.options import MTP_MODES
    return mode in MTP_MODES


def parse_modes(s: str) -> list[str]:
    """--mode: one mode or a comma list (kept in the order given, without repeats)."""
    out = []
    for m in (x.strip() for x in s.split(",")):
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
        if m not in out:
            out.append(m)
    if not out:
        raise argparse.ArgumentTypeError("expected one mode or a comma list of modes")
    return out


def mode_nodes(mode: str, nodes: list[int] | None, gamma: int) -> list[int]:
    """The verify widths N a mode runs: `nodes` (--nodes), else the mode's defaults (tree modes 8, 32; chain and
    ready 6 and γ + 1; mtp 4). A chain's N is its node count, anchor included: N − 1 drafts, at most γ for a
    DSpark chain (its block's draft slots); raises ValueError for an N the mode cannot verify."""
    if nodes is None:
        if not is_chain(mode):
            return list(DEFAULT_NODES)
        if uses_mtp(mode):
            return list(DEFAULT_MTP_NODES)
        return sorted({n for n in DEFAULT_CHAIN_NODES if n <= gamma + 1} | {gamma + 1})
    if is_chain(mode):
        most = None if uses_mtp(mode) else gamma + 1
        bad = [n for n in nodes if n < 2 or (most is not None and n > most)]
        if bad:
            raise ValueError(f"--nodes {','.join(map(str, bad))} does not apply to mode {mode}: a chain verifies N = "
                             f"drafts + 1 nodes, 2 ≤ N" + (f" ≤ γ + 1 = {most}" if most else ""))
    return list(nodes)


# ------------------------------------------------------------------------------------------------
# The drafter: geometry, random weights, random context
# ------------------------------------------------------------------------------------------------
def drafter_config(tcfg, *, tiny: bool = False, path: str | None = None, layers: int | None = None,
                   block_size: int | None = None, taps: tuple[int, ...] | None = None):
    """(DrafterConfig, source): a drafter config.json (`path`), a small drafter of the tiny target (`tiny`), else
    the published geometry (module docstring) beside `tcfg`. layers / block_size / taps override (None: the
    file's, else the published layers and block size)."""
    from hyspec_jax.config import DrafterConfig

    if path:
        p = Path(path)
        cfg = DrafterConfig.from_hf_dict(json.loads((p / "config.json" if p.is_dir() else p).read_text()))
        over = dict(num_hidden_layers=layers, target_layer_ids=taps, block_size=block_size)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in over.items() if v is not None})
        if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{path}: drafter hidden {cfg.hidden_size} / vocab {cfg.vocab_size} do not match the "
                             f"target's {tcfg.hidden_size} / {tcfg.vocab_size}")
        return cfg, str(path)
    block_size = block_size or PUBLISHED_BLOCK
    if tiny:
        n = layers or 2
        return DrafterConfig.from_target(
            tcfg, num_layers=n, block_size=block_size, markov_rank=16, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128,
            target_layer_ids=taps or tuple(np.linspace(0, tcfg.num_hidden_layers - 2, n).round().astype(int).tolist())
        ), "tiny drafter"
    return DrafterConfig.from_target(tcfg, num_layers=layers or PUBLISHED_LAYERS, target_layer_ids=taps,
                                     block_size=block_size, **PUBLISHED_DRAFTER), DRAFTER_SOURCE


def drafter_init_rules(model, reader_cfg) -> dict:
    """{parameter path: (kind, scale)} of a drafter: verify-scale's rules (`INIT_RULES`), the reader's own
    projections drawn as its initialiser draws them (unit variance over the fan-in), and the drafter's Qwen3 norms
    (not zero-centred: weight 1, never 0 — a zero weight would zero the block)."""
    from flax import nnx

    from hyspec_jax.bench.verify_scale import INIT_RULES, param_init_rules
    from hyspec_jax.models.layers import RMSNorm

    extra = {}
    if reader_cfg is not None:
        extra = {("Reader", "w_q"): ("normal", 1 / math.sqrt(reader_cfg.hidden_size)),
                 ("Reader", "u"): ("normal", 1 / math.sqrt(reader_cfg.rank)),
                 ("Reader", "v"): ("normal", 1 / math.sqrt(reader_cfg.value_dim))}
    rules = param_init_rules(model, {**INIT_RULES, **extra})
    for p, n in nnx.iter_graph(model):
        if isinstance(n, RMSNorm) and not n.zero_centred:
            rules[tuple(p) + ("weight",)] = ("const", 1.0)
    return rules


def random_drafter(dcfg, reader_cfg, dtype, seed: int, mesh, compiler_options: dict | None = None):
    """A `Drafter` with random weights (`drafter_init_rules`), built leaf by leaf on the device(s), replicated
    over `mesh` (as the engine places a drafter beside a sharded target)."""
    from hyspec_jax.models.drafter import abstract_drafter

    model = abstract_drafter(dcfg, reader_cfg, dtype)
    return _fill_module(model, drafter_init_rules(model, reader_cfg), mesh, seed, DRAFTER_STREAM, compiler_options)


def _fill_module(model, rules: dict, mesh, seed: int, stream: int, compiler_options: dict | None):
    """The abstract module `model` with every leaf filled on the device(s) by its rule (`fill_leaf`), replicated
    over `mesh`; `stream` keeps one module's random numbers apart from another's."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    graphdef, abstract = nnx.split(model)
    rep = NamedSharding(mesh, P())
    leaves = []
    for i, (p, v) in enumerate(nnx.to_flat_state(abstract)):
        a, (kind, scale) = v.get_value(), rules[tuple(p)]
        leaves.append((p, v.replace(value=fill_leaf(kind, scale, a.shape, a.dtype, rep, seed=seed, stream=stream,
                                                    index=i, compiler_options=compiler_options))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def random_drafter_state(dcfg, batch: int, max_len: int, prefix: int, dtype, seed: int, mesh,
                         compiler_options: dict | None = None):
    """A drafter context as after `prefix` committed tokens: random context K/V (N(0, 1)), lengths = prefix, in the
    request loop's slot layout (`sharding.slot_shardings`)."""
    import jax

    from hyspec_jax.sharding import slot_shardings
    from hyspec_jax.state import DrafterState, init_drafter_state

    abstract = jax.eval_shape(lambda: init_drafter_state(dcfg, batch, max_len, dtype))
    sh = slot_shardings(abstract, mesh)
    fill = lambda j, name, kind, scale: fill_leaf(  # noqa: E731
        kind, scale, getattr(abstract, name).shape, getattr(abstract, name).dtype, getattr(sh, name), seed=seed,
        stream=DSTATE_STREAM + batch, index=j, compiler_options=compiler_options)
    return DrafterState(keys=fill(0, "keys", "normal", 1.0), values=fill(1, "values", "normal", 1.0),
                        lengths=fill(2, "lengths", "const", prefix))


def mtp_config(tcfg):
    """The MTP head's config: the target's, with its declared MTP layer count (Qwen's published 1 where it declares
    none: `MTP_SOURCE`)."""
    return dataclasses.replace(tcfg, mtp_num_hidden_layers=tcfg.mtp_num_hidden_layers or MTP_LAYERS)


def random_mtp(mcfg, dtype, seed: int, mesh, compiler_options: dict | None = None):
    """An `MTPHead` with random weights, built leaf by leaf on the device(s) as the target's (verify-scale's
    `INIT_RULES`: its norms are the target's zero-centred ones, weight 0), replicated over `mesh`."""
    from hyspec_jax.bench.verify_scale import param_init_rules
    from hyspec_jax.models.mtp import abstract_mtp

    model = abstract_mtp(mcfg, dtype)
    return _fill_module(model, param_init_rules(model), mesh, seed, MTP_STREAM, compiler_options)


def random_mtp_state(mcfg, batch: int, max_len: int, prefix: int, dtype, seed: int, mesh,
                     compiler_options: dict | None = None):
    """The MTP head's cache as after `prefix` committed tokens: random K/V and pending hidden (N(0, 1)), lengths =
    prefix, in the request loop's slot layout."""
    import jax

    from hyspec_jax.models.mtp import MTPState, init_mtp_state
    from hyspec_jax.sharding import slot_shardings

    abstract = jax.eval_shape(lambda: init_mtp_state(mcfg, batch, max_len, dtype))
    sh = slot_shardings(abstract, mesh)
    fill = lambda j, name, kind, scale: fill_leaf(  # noqa: E731
        kind, scale, getattr(abstract, name).shape, getattr(abstract, name).dtype, getattr(sh, name), seed=seed,
        stream=MSTATE_STREAM + batch, index=j, compiler_options=compiler_options)
    return MTPState(keys=fill(0, "keys", "normal", 1.0), values=fill(1, "values", "normal", 1.0),
                    hidden=fill(2, "hidden", "normal", 1.0), lengths=fill(3, "lengths", "const", prefix))


# ------------------------------------------------------------------------------------------------
# Projection
# ------------------------------------------------------------------------------------------------
def projected_speedup(tau: float, t_dec_ms: float, t_round_ms: float) -> float:
    """Speed-up over plain decoding if every round commits τ tokens per request: τ · T_dec / T_round."""
    if tau <= 0 or t_dec_ms <= 0 or t_round_ms <= 0:
        raise ValueError(f"τ, T_dec and T_round must be > 0, got {tau}, {t_dec_ms}, {t_round_ms}")
    return tau * t_dec_ms / t_round_ms


def embedded_taus(path, mode: str, tree: tuple[int, int, int], nodes) -> dict[int, dict]:
    """{N: dict(tau, batch, entry, source)}: the τ a `hyspec bench e2e` JSON measured for `mode` with the same tree
    (its meta.tree depth / top_k / beam) at verify width N, for N in `nodes` (the smallest batch's entry where
    several batches measured it). Empty when the file's tree is another."""
    from hyspec_jax.bench.report import portable_path

    d = json.loads(Path(path).read_text())
    t = (d.get("meta") or {}).get("tree") or {}
    if (t.get("depth"), t.get("top_k"), t.get("beam")) != tuple(tree):
        return {}
    out: dict[int, dict] = {}
    for key, r in (d.get("results") or {}).items():
        N, tau = r.get("verify_nodes"), r.get("mean_tau")
        if r.get("mode") != mode or N not in nodes or tau is None:
            continue
        if N not in out or (r.get("batch") or 0) < (out[N]["batch"] or 0):
            out[N] = dict(tau=float(tau), batch=r.get("batch"), entry=key, source=portable_path(path))
    return out


def projections(row: dict, t_dec_ms: float, taus: dict, target: float) -> dict:
    """A row's projected speed-ups {published, embedded} at its mode's τ for its N (None without one) and whether
    each reaches `target`."""
    mode, n = row["mode"], str(row["nodes"])
    out = {}
    for name in ("published", "embedded"):
        tau = taus[name].get(mode, {})
        tau = (tau.get("tau") or {}).get(n) if name == "published" else (tau.get(n) or {}).get("tau")
        s = None if tau is None else round(projected_speedup(tau, t_dec_ms, row["t_round_ms"]), 4)
        out[name] = dict(tau=tau, speedup=s, meets=None if s is None else s >= target)
    return out


# ------------------------------------------------------------------------------------------------
# Programs of one batch
# ------------------------------------------------------------------------------------------------
class _Lower:
    """A `compile_all` job's function: .lower() of a jitted program with its static arguments bound."""

    def __init__(self, fn):
        self.lower = fn


class BatchRounds:
    """One batch B: its committed state (target, drafter context and/or MTP cache, anchors), the engine backend of
    every (mode, N), and the jobs of its programs; `measure_*` time a compiled program and return its JSON row."""

    def __init__(self, args, cfg, dcfg, mcfg, B: int, engines: dict, *, mesh, dtype, max_len: int):
        import jax
        import jax.numpy as jnp

        from hyspec_jax.runtime.backend import Backend
        from hyspec_jax.spec.round import StepInputs

        self.args, self.B, self.engines, self.max_len = args, B, engines, max_len
        copts = dict(args.xla_option) or None
        # the buckets' backends: round shapes and capacity as the engine builds them (their empty buffers are
        # dropped: the rounds run on the random committed state below)
        self.backends = {}
        for key, eng in engines.items():
            be = eng.backend(B, max_len, shapes=[(B, 16)])
            be.state = be.dstate = be.anchor = None
            self.backends[key] = be
        self.state, _ = random_state(cfg, B, max_len, args.prefix, dtype, args.seed, mesh, copts)
        # the drafter's context (DSpark modes) and the MTP head's cache (MTP modes), each beside the same target state
        self.dstates = {}
        if dcfg is not None:
            self.dstates["dspark"] = random_drafter_state(dcfg, B, max_len, args.prefix, dtype, args.seed, mesh, copts)
        if mcfg is not None:
            self.dstates["mtp"] = random_mtp_state(mcfg, B, max_len, args.prefix, dtype, args.seed, mesh, copts)
        rng = np.random.default_rng([args.seed, B])
        self.anchor = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32),
                                     self.state.lengths.sharding)
        self.lengths = np.asarray(self.state.lengths)
        self.dlengths = {k: np.asarray(d.lengths) for k, d in self.dstates.items()}
        z = np.zeros(B, np.float32)
        self.sampling = Backend.sampling(z, np.ones(B, np.float32), z.astype(np.int32), z.astype(np.uint32))
        self.active, self.steps = np.ones(B, bool), np.ones(B, np.int32)
        self.inputs = {key: StepInputs(StepInputs.pack(self.active, self.steps, be.capacity), self.sampling)
                       for key, be in self.backends.items()}
        self.step_inputs = StepInputs(StepInputs.pack(self.active, self.steps), self.sampling)
        eng = next(iter(engines.values()))
        self.tg, self.tp = eng.tgraph, eng.tparams

    @staticmethod
    def kind(mode: str) -> str:
        """Which drafting state a mode's round reads and donates: "mtp" (the MTP head's cache) or "dspark"."""
        return "mtp" if uses_mtp(mode) else "dspark"

    def _slots(self, kind: str | None = None):
        """The slot state a program takes: the target's, with `kind` that drafting state."""
        from hyspec_jax.spec.round import SlotState
        return SlotState(self.state, None if kind is None else self.dstates[kind])

    def _phase_args(self, key):
        mode, _ = key
        return self._slots(self.kind(mode)), self.anchor, self.inputs[key]

    def jobs(self, phases: bool) -> list:
        """(key, lowerable, ()) of compile_all: ("decode", B, 0, "") and, per (mode, N), ("round", B, N, mode) and,
        with phases, ("draft", B, N, mode) and ("verify", B, N, mode)."""
        import functools

        import jax

        from hyspec_jax.runtime.programs import ar_step_jit, spec_round_io_jit
        from hyspec_jax.spec.round import round_draft, round_draft_jit, round_verify_jit

        B, tg, tp = self.B, self.tg, self.tp
        first = [(("decode", B, 0, ""), _Lower(lambda: ar_step_jit.lower(
            tg, tp, self._slots(), self.anchor, self.step_inputs, stochastic=False)), ())]
        extra = []
        for (mode, N), be in self.backends.items():
            shape, key, kind = be.round_shapes[False], (mode, N), self.kind(mode)
            first.append((("round", B, N, mode), _Lower(
                lambda be=be, shape=shape, key=key, kind=kind: spec_round_io_jit.lower(
                    be.graphdef, be.params, be.dgraph, be.dparams, self._slots(kind), self.anchor, self.inputs[key],
                    shape=shape)), ()))
            if not phases:
                continue
            pargs = self._phase_args(key)
            extra.append((("draft", B, N, mode), _Lower(lambda be=be, shape=shape, pargs=pargs: round_draft_jit.lower(
                be.graphdef, be.params, be.dgraph, be.dparams, *pargs, shape=shape)), ()))
            # the verify reads the draft's forest: its shapes, without running it
            draft = jax.eval_shape(functools.partial(round_draft, be.graphdef, be.params, be.dgraph, be.dparams,
                                                     shape=shape), *pargs)
            extra.append((("verify", B, N, mode), _Lower(lambda be=be, shape=shape, draft=draft:
                                                         round_verify_jit.lower(be.graphdef, be.params, self.state,
                                                                                draft, shape=shape)), ()))
        return first, extra

    def _restore(self, kind: str | None = None):
        """Untimed before each call of a donating program: the committed lengths of the prefix again (the target's
        and, with `kind`, that drafting state's)."""
        import jax

        self.state = self.state.replace(lengths=jax.device_put(self.lengths, self.state.lengths.sharding))
        if kind is None:
            return self.state.lengths
        d = self.dstates[kind]
        self.dstates[kind] = d = d.replace(lengths=jax.device_put(self.dlengths[kind], d.lengths.sharding))
        return self.state.lengths, d.lengths

    def _timing(self, t, prog) -> dict:
        compiled, lower_s, compile_s = prog
        return dict(t_ms=_ms(t.median_s), times_ms=[_ms(x) for x in t.times_s], first_ms=_ms(t.first_s),
                    spread=round(t.spread, 4), lower_s=round(lower_s, 3), compile_s=round(compile_s, 3),
                    **_xla_stats(compiled))

    def measure_decode(self, prog) -> dict:
        """T_dec: `ARBackend.dispatch` + `collect` of every slot, state donated and fed back."""
        from hyspec_jax.runtime.backend import start_host_copy

        step = prog[0]
        tp, args = self.tp, self.args

        def call():
            self.anchor, slots, _ = step(tp, self._slots(), self.anchor, self.step_inputs)
            self.state = slots.target
            start_host_copy(self.anchor)
            return np.asarray(self.anchor), self.state.lengths

        t, _ = median_time(call, args.repeats, args.warmup, before=self._restore)
        return dict(batch=self.B, **self._timing(t, prog))

    def measure_round(self, key, prog) -> dict:
        """T_round of (mode, N): `SpecBackend.dispatch` + `collect`, target and drafting state donated and fed
        back."""
        from hyspec_jax.runtime.backend import start_host_copy
        from hyspec_jax.spec.round import RoundOutput, StepInputs

        (mode, N), rnd, be = key, prog[0], self.backends[key]
        kind, box = self.kind(mode), {}

        def call():
            inputs = StepInputs(StepInputs.pack(self.active, self.steps, be.capacity), self.sampling)
            slots, self.anchor, out = rnd(be.params, be.dparams, self._slots(kind), self.anchor, inputs)
            self.state, self.dstates[kind] = slots.target, slots.drafter
            start_host_copy(out)
            box["out"] = np.asarray(out)
            return self.state.lengths, self.dstates[kind].lengths

        t, _ = median_time(call, self.args.repeats, self.args.warmup, before=lambda: self._restore(kind))
        res = RoundOutput.unpack(box["out"])
        count, accepted = res.count, res.accepted
        shape = be.round_shapes[False]
        return dict(mode=mode, batch=self.B, nodes=N, depth=shape.depth, capacity=be.capacity,
                    kernels=shape.kernel_impl, accepted_per_round=round(float(np.mean(accepted)), 4),
                    committed_per_round=round(float(np.mean(count)), 4), **self._timing(t, prog))

    def measure_phases(self, key, draft, verify) -> dict:
        """T_draft and T_verify of (mode, N) (either prog may be None: not compiled): no donation, the current
        state."""
        from hyspec_jax.bench.verify_scale import _finite

        out, be = {}, self.backends[key]
        if draft is None:
            return out
        pargs = self._phase_args(key)
        t, drafted = median_time(lambda: draft[0](be.params, be.dparams, *pargs), self.args.repeats, self.args.warmup)
        out["draft"] = self._timing(t, draft)
        if verify is not None:
            t, verified = median_time(lambda: verify[0](be.params, self.state, drafted), self.args.repeats,
                                      self.args.warmup)
            out["verify"] = dict(self._timing(t, verify), finite=_finite(verified.logits))
        return out


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------
def published_taus(modes: list[str], nodes: dict[str, list[int]], tau: float | None) -> dict:
    """{mode: {label, source, tau: {str(N): τ}}}: --published-tau (`tau`) at every N, else each mode's published τ
    (`PUBLISHED_TAUS`) at the N it was published for (a chain: N − 1 drafts; a tree mode: every N)."""
    out = {}
    for m in modes:
        if tau is not None:
            out[m] = dict(label="--published-tau", source="--published-tau", tau={str(n): tau for n in nodes[m]})
        elif m in PUBLISHED_TAUS:
            label, source, t = PUBLISHED_TAUS[m]
            by = ({str(n): t for n in nodes[m]} if isinstance(t, float)
                  else {str(n): t[n - 1] for n in nodes[m] if n - 1 in t})
            out[m] = dict(label=label, source=source, tau=by)
        else:
            out[m] = dict(label=None, source="none published", tau={})
    return out


def resolve_taus(args, nodes: dict[str, list[int]]) -> dict:
    """{published: {mode: ...} (`published_taus`), published_note, embedded: {mode: {str(N): {...}}},
    embedded_note}."""
    from hyspec_jax.bench.report import portable_path

    pub = published_taus(args.mode, nodes, args.published_tau)
    out = dict(published=pub, embedded={})
    none = [f"{m} N={n}" for m in args.mode for n in nodes[m] if str(n) not in pub[m]["tau"]]
    if none:
        out["published_note"] = f"no published τ for {', '.join(none)}: no projection at a published τ"
    path = Path(args.tau_from) if args.tau_from else DEFAULT_TAU_FILE
    if not path.is_file():
        if args.tau_from:
            raise ValueError(f"--tau-from {args.tau_from}: no such file")
        out["embedded_note"] = f"{path.name} not found: no projection at the embedded model's τ"
        return out
    tree, missing = (args.tree_depth, args.tree_topk, args.tree_beam), []
    for m in args.mode:
        found = embedded_taus(path, m, tree, set(nodes[m]))
        out["embedded"][m] = {str(N): v for N, v in sorted(found.items())}
        missing += [f"{m} N={n}" for n in nodes[m] if n not in found]
    if missing:
        out["embedded_note"] = (f"{portable_path(path)} has no τ with tree {args.tree_depth}/{args.tree_topk}/"
                                f"{args.tree_beam} for {', '.join(missing)}")
    return out


def program_label(kind: str, B: int, N: int = 0, mode: str = "") -> str:
    """How a program is named in "skipped": "decode B=1", "round tree-ready B=1 N=8"."""
    return f"{kind} B={B}" if kind == "decode" else f"{kind} {mode} B={B} N={N}"


def sweep(args, cfg, name: str, on_progress=None) -> dict:
    """Weights, every batch's state, every program lowered and compiled ahead of time, then each one timed;
    `on_progress(report)` after each measured program."""
    import jax
    from flax import nnx

    from hyspec_jax.bench.report import portable_args, portable_command, run_metadata
    from hyspec_jax.config import resolve_dtype
    from hyspec_jax.models.reader import ReaderConfig
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    from hyspec_jax.tree import TreeExpansion

    t_start = time.perf_counter()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    dtype = resolve_dtype(args.dtype)
    modes = args.mode
    dspark = [m for m in modes if not uses_mtp(m)]
    dcfg = dsource = rcfg = mcfg = None
    if dspark:
        dcfg, dsource = drafter_config(cfg, tiny=args.tiny, path=args.drafter_config, layers=args.draft_layers,
                                       block_size=args.block_size, taps=args.taps)
        if any(m in ("ready", "tree-ready") for m in dspark):    # one drafter; the other modes run without the reader
            rcfg = ReaderConfig.for_target(cfg, hidden_size=dcfg.hidden_size)
    if len(dspark) < len(modes):
        mcfg = mtp_config(cfg)
    nodes = {m: mode_nodes(m, args.nodes, dcfg.num_draft_tokens if dcfg is not None else 0) for m in modes}
    taus = resolve_taus(args, nodes)
    tree = TreeExpansion(args.tree_depth, args.tree_topk, args.tree_beam)
    mesh = make_mesh(1)
    copts = dict(args.xla_option) or None
    t0 = time.perf_counter()
    graphdef, params, _ = random_params(cfg, dtype, args.seed, mesh, copts, scan=args.scan_layers)
    drafter = None if dcfg is None else random_drafter(dcfg, rcfg, dtype, args.seed, mesh, copts)
    head = None if mcfg is None else random_mtp(mcfg, dtype, args.seed, mesh, copts)
    jax.block_until_ready((params, *(nnx.state(m) for m in (drafter, head) if m is not None)))
    init_s = time.perf_counter() - t0
    target = nnx.merge(graphdef, params)

    def spec(mode: str, N: int) -> SpecConfig:
        """The engine's settings of (mode, N): a tree verifies N of its nodes, a chain N − 1 drafts and its anchor
        (`Engine` sets a chain's width to its length + 1)."""
        kw = dict(tree=tree) if not is_chain(mode) else dict(chain_length=N - 1)
        return SpecConfig(mode=mode, verify_nodes=N, kernels=args.kernels, adaptive_width=False, **kw)

    engines = {(m, N): Engine(target, head if uses_mtp(m) else drafter, spec(m, N)) for m in modes
               for N in nodes[m]}
    overshoot = max(e.overshoot for e in engines.values())      # `Engine.overshoot`: the round's depth + 2
    max_len = args.max_len or args.prefix + max(max(max(n) for n in nodes.values()), overshoot)
    if max_len < args.prefix + overshoot:
        raise ValueError(f"--max-len {max_len} must hold --prefix {args.prefix} + a round's {overshoot} positions")
    count = lambda tree_: (sum(int(x.size) for x in jax.tree.leaves(tree_)),  # noqa: E731
                           sum(int(x.nbytes) for x in jax.tree.leaves(tree_)))
    tn, tb = count(params)
    drafter_row = mtp_row = None
    if drafter is not None:
        dn, db = count(nnx.state(drafter))
        drafter_row = dict(source=dsource, config=dataclasses.asdict(dcfg), gamma=dcfg.num_draft_tokens,
                           reader=None if rcfg is None else rcfg.to_dict(), param_count=dn, param_bytes=db)
    if head is not None:
        mn, mb = count(nnx.state(head))
        mtp_row = dict(source=MTP_SOURCE, layers=mcfg.mtp_num_hidden_layers, hidden_size=mcfg.hidden_size,
                       num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=mcfg.num_key_value_heads,
                       head_dim=mcfg.head_dim, intermediate_size=mcfg.intermediate_size, moe=mcfg.is_moe,
                       param_count=mn, param_bytes=mb)
    report = dict(
        meta=run_metadata(), command=portable_command("hyspec bench round-scale", args.argv),
        argv=portable_args(args.argv), status="partial",
        model=dict(name=name, config=dataclasses.asdict(cfg), param_count=tn, param_bytes=tb),
        drafter=drafter_row, mtp=mtp_row,
        settings=dict(modes=modes, tree=dict(depth=tree.depth, top_k=tree.top_k, beam=tree.beam),
                      dtype=str(np.dtype(dtype)), prefix=args.prefix, max_len=max_len, kernels=args.kernels,
                      repeats=args.repeats, warmup=args.warmup, batches=args.batch, nodes=nodes,
                      seed=args.seed, phases=not args.no_phases, target=args.target,
                      compile_workers=args.compile_workers, compile_cache=args.compile_cache,
                      xla_options=dict(args.xla_option), max_seconds=args.max_seconds,
                      scan_layers=args.scan_layers),
        taus=taus, init_s=round(init_s, 3), decode=[], rows=[], skipped=[])
    batches = {B: BatchRounds(args, cfg, dcfg, mcfg, B, engines, mesh=mesh, dtype=dtype, max_len=max_len)
               for B in args.batch}
    main_jobs, extra_jobs = [], []
    for B in args.batch:                                        # batch 1 first; the phases alone after all rounds
        m, e = batches[B].jobs(not args.no_phases)
        main_jobs += m
        extra_jobs += e
    jobs = main_jobs + extra_jobs
    bar = progress_bar(2 * len(jobs), not args.no_progress)    # compile + measure
    t_dec: dict[int, float] = {}

    def update():
        report["wall_s"] = round(time.perf_counter() - t_start, 2)
        bar.update()
        if on_progress is not None:
            on_progress(report)

    try:
        bar.set_description("compile")
        progs = compile_all(jobs, args.compile_workers, bar, deadline=deadline)
        bar.set_description("measure")
        report["skipped"] = [program_label(*k) for k, _, _ in jobs if k not in progs]
        for B in args.batch:
            br = batches[B]
            if ("decode", B, 0, "") in progs:
                d = br.measure_decode(progs.pop(("decode", B, 0, "")))
                t_dec[B] = d["t_ms"]
                report["decode"].append(d)
                bar.set_postfix_str(f"T_dec B={B} {d['t_ms']:.3f} ms")
                update()
            for mode in modes:
                for N in nodes[mode]:
                    if ("round", B, N, mode) not in progs:
                        continue
                    row = br.measure_round((mode, N), progs.pop(("round", B, N, mode)))
                    phases = br.measure_phases((mode, N), progs.pop(("draft", B, N, mode), None),
                                               progs.pop(("verify", B, N, mode), None))
                    row.update(t_round_ms=row.pop("t_ms"), phases=phases,
                               t_draft_ms=phases.get("draft", {}).get("t_ms"),
                               t_verify_ms=phases.get("verify", {}).get("t_ms"), t_dec_ms=t_dec.get(B))
                    if B in t_dec:
                        row["round_over_dec"] = round(row["t_round_ms"] / t_dec[B], 4)
                        row["projections"] = projections(row, t_dec[B], taus, args.target)
                    report["rows"].append(row)
                    bar.set_postfix_str(f"T_round {mode} B={B} N={N} {row['t_round_ms']:.3f} ms")
                    update()
                    for _ in phases:
                        update()
            del batches[B]                                      # frees the batch's states
    finally:
        bar.close()
    if report["skipped"]:
        report["stopped"] = f"--max-seconds {args.max_seconds:g}: {len(report['skipped'])} program(s) not measured"
    report["status"] = "partial" if report["skipped"] else "complete"
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    report["device_memory"] = device_memory()
    return report


def device_memory() -> dict | None:
    """The device allocator's peak and limit (bytes) over the run, where the backend reports them (GPU)."""
    import jax

    try:
        m = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 — optional diagnostics, not every backend has them
        return None
    out = {k: int(m[k]) for k in ("peak_bytes_in_use", "bytes_limit") if k in m}
    return out or None


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def all_finite(report: dict) -> bool:
    """Every measured verify phase gave finite logits."""
    return all(r.get("phases", {}).get("verify", {}).get("finite", True) for r in report["rows"])


def _f(x, nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def _proj(p: dict | None, with_tau: bool) -> str:
    if not p or p["speedup"] is None:
        return "—"
    return f"{p['speedup']:.2f}×" + (f" at τ {p['tau']:.2f}" if with_tau else "") + \
        f" ({'meets' if p['meets'] else 'below'})"


def _sorted_rows(report: dict) -> list[dict]:
    order = {m: i for i, m in enumerate(report["settings"]["modes"])}
    return sorted(report["rows"], key=lambda r: (order.get(r["mode"], len(order)), r["batch"], r["nodes"]))


def _projection_header(report: dict, name: str) -> tuple[str, bool]:
    """The header of a projection column, naming its τ's source(s), and whether each cell shows its τ (the rows'
    τ differ)."""
    rows = [r for r in report["rows"] if ((r.get("projections") or {}).get(name) or {}).get("tau") is not None]
    taus = sorted({r["projections"][name]["tau"] for r in rows})
    if name == "published":
        pub = report["taus"]["published"]
        labels = list(dict.fromkeys(pub[r["mode"]]["label"] for r in _sorted_rows(dict(report, rows=rows))))
        src = " / ".join(x if x == "--published-tau" else f"{x}, published" for x in labels) or "none published"
    else:
        src = "embedded model, measured"
    if len(taus) <= 1:
        return f"PROJECTED speed-up, τ {_f(taus[0] if taus else None, 2)} ({src})", False
    return f"PROJECTED speed-up at each row's τ ({src})", len(taus) > 1


def summary_table(report: dict) -> str:
    (pub, pub_tau), (emb, emb_tau) = (_projection_header(report, n) for n in ("published", "embedded"))
    head = ["mode", "B", "N", "T_round ms", "T_draft ms", "T_verify ms", "T_dec ms", "T_round / T_dec", pub, emb,
            "accepted / round (random weights)"]
    out = ["| " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * 5 + "---|---|---:|"]
    for r in _sorted_rows(report):
        p = r.get("projections") or {}
        out.append(f"| {r['mode']} | {r['batch']} | {r['nodes']} | {r['t_round_ms']:.3f} | {_f(r.get('t_draft_ms'))} | "
                   f"{_f(r.get('t_verify_ms'))} | {_f(r.get('t_dec_ms'))} | {_f(r.get('round_over_dec'), 2)} | "
                   f"{_proj(p.get('published'), pub_tau)} | {_proj(p.get('embedded'), emb_tau)} | "
                   f"{r['accepted_per_round']:.2f} |")
    return "\n".join(out)


def target_line(report: dict) -> str:
    """Which (mode, B, N) reach the target at each τ (projections)."""
    tgt, parts = report["settings"]["target"], []
    one = len({r["mode"] for r in report["rows"]}) <= 1
    for name, label in (("published", "published τ"), ("embedded", "embedded τ")):
        rows = [r for r in _sorted_rows(report)
                if (r.get("projections") or {}).get(name, {}).get("speedup") is not None]
        ok = [("" if one else f"{r['mode']} ") + f"B={r['batch']} N={r['nodes']}" for r in rows
              if r["projections"][name]["meets"]]
        parts.append(f"at the {label}: " + ("no row projected" if not rows else
                                           f"{len(ok)} of {len(rows)} rows ({', '.join(ok) or 'none'})"))
    return f"Target ≥ {tgt:g}× (PROJECTED) — " + "; ".join(parts) + "."


def _drafter_line(d: dict, modes: list[str]) -> str:
    dc = d["config"]
    users = [m for m in modes if not uses_mtp(m)]
    return (f"DSpark drafter ({', '.join(users)}) {_count(d['param_count'])} parameters ({_gib(d['param_bytes'])}): "
            f"{dc['num_hidden_layers']} layers, hidden {dc['hidden_size']}, {dc['num_attention_heads']} q / "
            f"{dc['num_key_value_heads']} kv heads of {dc['head_dim']}, intermediate {dc['intermediate_size']}, "
            f"taps {dc['target_layer_ids']}, γ {d['gamma']}, Markov rank {dc['markov_rank']}"
            + (f", ReaDy reader of layers {d['reader']['source_layers']} (rank {d['reader']['rank']}; read by the "
               "ready modes only)" if d["reader"] else "") + f" — {d['source']}.")


def _mtp_line(h: dict, modes: list[str]) -> str:
    users = [m for m in modes if uses_mtp(m)]
    return (f"MTP head ({', '.join(users)}; no separate drafter) {_count(h['param_count'])} parameters "
            f"({_gib(h['param_bytes'])}): {h['layers']} layer(s) at hidden {h['hidden_size']}, "
            f"{h['num_attention_heads']} q / {h['num_key_value_heads']} kv heads of {h['head_dim']}, "
            + ("sparse MoE" if h.get("moe") else f"intermediate {h['intermediate_size']}")
            + f" — {h['source']}.")


def markdown(report: dict) -> str:
    meta, s, m, taus = report["meta"], report["settings"], report["model"], report["taus"]
    t, modes = s["tree"], s["modes"]
    emb = "; ".join(f"{mode} N={n}: τ {v['tau']:.3f} ({v['source']}, entry `{v['entry']}`)"
                    for mode, by in taus["embedded"].items() for n, v in by.items()) or "none"
    groups: dict[str, list[str]] = {}                       # source -> its modes' τ per N
    for mode, v in taus["published"].items():
        if v["tau"]:
            groups.setdefault(v["source"], []).append(
                f"{mode} " + ", ".join(f"N={n} τ {x:.4g}" for n, x in v["tau"].items()))
    pub = "; ".join(f"{', '.join(items)} ({src})" for src, items in groups.items()) or "none"
    chains = [x for x in modes if is_chain(x)]
    nodes = "; ".join(f"{mode} {', '.join(map(str, s['nodes'][mode]))}" for mode in modes)
    lines = [
        f"# One speculative round at scale — {m['name']}, {meta['device_kind']}, {s['dtype']}, prefix {s['prefix']}",
        "", f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['time_utc']}; status "
        f"**{report['status']}**" + (f", wall {report['wall_s']:.0f} s" if "wall_s" in report else "")
        + (f" (merged from {', '.join(report['merged_from'])})" if report.get("merged_from") else ""), "",
        f"Random weights. Target {_count(m['param_count'])} parameters ({_gib(m['param_bytes'])})."
        + (" " + _drafter_line(report["drafter"], modes) if report.get("drafter") else "")
        + (" " + _mtp_line(report["mtp"], modes) if report.get("mtp") else ""), "",
        f"Mode{'s' if len(modes) > 1 else ''} {', '.join(f'`{x}`' for x in modes)}; N {nodes}"
        + (f" ({', '.join(chains)}: a chain's N is its node count, N − 1 drafts and the anchor)" if chains else "")
        + (f"; tree depth {t['depth']} / top-k {t['top_k']} / beam {t['beam']}" if len(chains) < len(modes) else "")
        + f"; kernels `{s['kernels']}`, KV length {s['max_len']}. Each time: median of {s['repeats']} calls after "
        f"{s['warmup']} warm-up call(s). T_round: the engine's round program for the bucket (draft + verify + "
        "commit, state donated), called as the request loop calls it; T_draft / T_verify: its draft and verify "
        "phases jitted alone; T_dec: the request loop's plain decoding step (one per batch, shared by the modes).",
        "",
        "**Speed-ups are PROJECTIONS** (τ · T_dec / T_round), not measurements: random weights accept "
        f"(almost) no draft (last column). Published τ: {pub}"
        + (f" ({taus['published_note']})" if taus.get("published_note") else "")
        + (" — a tree mode's is its source's own drafting, not this tree's" if any(
            not is_chain(x) and v["tau"] and v["label"] != "--published-tau" for x, v in taus["published"].items())
           else "") + ". "
        f"Embedded model's τ: {emb}" + (f" ({taus['embedded_note']})" if taus.get("embedded_note") else "") + ".",
        "", summary_table(report), "", target_line(report), "",
    ]
    if report.get("skipped"):
        lines += [f"Not measured ({report.get('stopped', 'run cut short')}): " + ", ".join(report["skipped"]), ""]
    dec = ", ".join(f"B={x['batch']} {x['t_ms']:.3f} ms (compile {x['compile_s']:.0f} s)" for x in report["decode"])
    comp = ", ".join(f"{r['mode']} B={r['batch']} N={r['nodes']} {r['compile_s']:.0f} s" for r in _sorted_rows(report))
    mem = report.get("device_memory") or {}
    lines += [f"T_dec: {dec or '—'}. Round compiles: {comp or '—'}."
              + (f" Device memory: peak {_gib(mem['peak_bytes_in_use'])} of {_gib(mem['bytes_limit'])}."
                 if {"peak_bytes_in_use", "bytes_limit"} <= set(mem) else ""), ""]
    if not all_finite(report):
        lines += ["**WARNING: non-finite verify logits in at least one row (see the JSON).**", ""]
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """One report from runs of the same target and settings but other batches, N or modes (a later run's rows
    win; runs of different modes must share the KV length: --max-len)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    loose = {"modes", "batches", "nodes", "compile_workers", "compile_cache", "max_seconds", "phases"}
    key = lambda r: (r["model"]["name"], {k: v for k, v in r["settings"].items() if k not in loose})  # noqa: E731
    rows, dec, models = {}, {}, {"drafter": None, "mtp": None}
    modes, nodes, taus = [], {}, dict(published={}, embedded={})
    notes = {"published_note": [], "embedded_note": []}
    for p, r in zip(paths, reports):
        if "modes" not in r["settings"]:
            raise ValueError(f"{p}: written before round-scale recorded its modes; cannot merge")
        if key(r) != key(reports[0]):
            differ = sorted(k for k in set(key(r)[1]) | set(key(reports[0])[1])
                            if key(r)[1].get(k) != key(reports[0])[1].get(k))
            raise ValueError(f"{p}: model or settings ({', '.join(differ) or 'model'}) differ from {paths[0]}; "
                             "cannot merge")
        for name in models:
            x = r.get(name)
            if x is None:
                continue
            y = models[name]
            if y is not None and (x.get("config") != y.get("config") or x.get("layers") != y.get("layers")):
                raise ValueError(f"{p}: {name} geometry differs from an earlier run's; cannot merge")
            if y is None or (name == "drafter" and x.get("reader") and not y.get("reader")):
                models[name] = x
        for m in r["settings"]["modes"]:
            if m not in modes:
                modes.append(m)
            nodes[m] = sorted(set(nodes.get(m, [])) | set(r["settings"]["nodes"][m]))
        for name in ("published", "embedded"):
            taus[name].update(r["taus"][name])
        for name in notes:
            if r["taus"].get(name) and r["taus"][name] not in notes[name]:
                notes[name].append(r["taus"][name])
        rows.update({(x["mode"], x["batch"], x["nodes"]): x for x in r["rows"]})
        dec.update({x["batch"]: x for x in r["decode"]})
    base = dict(reports[0], merged_from=list(paths), **models)
    base["settings"] = dict(base["settings"], modes=modes, nodes=nodes, batches=sorted(
        {b for r in reports for b in r["settings"]["batches"]}))
    base["taus"] = dict(taus, **{k: "; ".join(v) for k, v in notes.items() if v})
    base["rows"] = _sorted_rows(dict(base, rows=list(rows.values())))
    base["decode"] = [dec[k] for k in sorted(dec)]
    done = {program_label("decode", b) for b in dec} | {program_label(k, b, n, m) for (m, b, n), x in rows.items()
                                                        for k in ("round", *x.get("phases", {}))}
    return settle_merged(base, reports, done)


def write_outputs(report: dict, json_path: str | None) -> None:
    from hyspec_jax.bench.report import write_report
    write_report(report, json_path, markdown)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _taps(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative layer ids, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench round-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry_arguments(ap, "a small target and drafter (CPU smoke run, tests)",
                           "target config.json or model directory (default: Qwen3.8-27B)")
    ap.add_argument("--batch", type=_ints, default=list(DEFAULT_BATCH), metavar="B,..", help="batches (default 1,8,32)")
    ap.add_argument("--nodes", type=_ints, metavar="N,..",
                    help="verify widths N, anchor included, for every mode (default per mode: tree modes 8,32; chain "
                         "and ready 6 and γ + 1; mtp 4). A chain's N (chain, ready, mtp) is its node count: N − 1 "
                         "drafts and the anchor, 2 ≤ N (≤ γ + 1 for a DSpark chain); another N is an error")
    ap.add_argument("--mode", type=parse_modes, default=[MODES[0]], metavar="MODE[,MODE..]",
                    help=f"speculative mode(s), {', '.join(MODES)} (default tree-ready); a comma list runs each "
                         "mode's rounds in one process beside one decoding step per batch. The mtp modes draft "
                         "with the target's own MTP head (Qwen's published layout), the others with the DSpark "
                         "drafter")
    ap.add_argument("--tree-depth", type=int, default=DEFAULT_TREE[0], metavar="D", help="tree levels (default 7)")
    ap.add_argument("--tree-topk", type=int, default=DEFAULT_TREE[1], metavar="K",
                    help="children per tree node (default 8)")
    ap.add_argument("--tree-beam", type=int, default=DEFAULT_TREE[2], metavar="W",
                    help="tree nodes kept per level (default 16)")
    ap.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                    help="tree top-k, tree solve, tree attention, commit (default auto: the engine's default)")
    ap.add_argument("--prefix", type=int, default=512, metavar="P", help="committed tokens per slot (default 512)")
    ap.add_argument("--max-len", type=int, metavar="S", help="KV length (default prefix + max(max N, γ + 2))")
    ap.add_argument("--block-size", type=int, metavar="G",
                    help="drafter block size γ (default 7: ReaDy's Qwen3.8-27B setting; with --drafter-config: its own)")
    ap.add_argument("--draft-layers", type=int, metavar="L", help="drafter layers (default 5; --tiny 2)")
    ap.add_argument("--taps", type=_taps, metavar="I,..", help="tapped target layers (default: the z-lab rule)")
    ap.add_argument("--drafter-config", metavar="PATH", help="a drafter config.json (or its directory) instead of "
                                                             "the published geometry")
    ap.add_argument("--published-tau", type=float, metavar="T",
                    help="τ of the first projection, for every mode and N (default: each mode's published τ on "
                         "Qwen3.8-27B — tree, tree-ready: ReaDy's 4.5285 (arXiv 2610.20503 Table 1) at every N; "
                         "ready: the same at N 8; chain: DSpark v2's 3.73 at N 6; mtp: the MTP head's 1.90 / 2.68 "
                         "/ 3.28 / 3.79 at N 2 / 3 / 4 / 5 (docs/reference/drafters.md §10); mtp-tree: none)")
    ap.add_argument("--tau-from", metavar="E2E.json", help="a `hyspec bench e2e` JSON whose τ of the same mode, "
                    "tree and N gives the second projection (default bench/results/e2e/e2e_h100_loop.json)")
    ap.add_argument("--target", type=float, default=TARGET, metavar="X", help="speed-up target (default 1.8)")
    ap.add_argument("--no-phases", action="store_true", help="time the round and the decoding step only")
    ap.add_argument("--repeats", type=int, default=10, metavar="K", help="timed calls per program (default 10)")
    ap.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed calls first (default 2)")
    add_run_arguments(ap, max_seconds="lower no further program once S seconds have passed since the start (those "
                      "compiled are still measured); the JSON then has status partial and lists the skipped")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if min(args.repeats, args.warmup, args.tree_depth, args.tree_topk, args.tree_beam, args.block_size or 1) < 1:
        ap.error("--repeats, --warmup, --tree-depth, --tree-topk, --tree-beam and --block-size must be ≥ 1")
    if args.prefix < 0 or (args.draft_layers is not None and args.draft_layers < 1):
        ap.error("--prefix must be ≥ 0 and --draft-layers ≥ 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if (args.published_tau is not None and args.published_tau <= 0) or args.target <= 0:
        ap.error("--published-tau and --target must be > 0")
    if not args.merge and all(uses_mtp(m) for m in args.mode):
        used = [f for f, v in (("--block-size", args.block_size), ("--draft-layers", args.draft_layers),
                               ("--taps", args.taps), ("--drafter-config", args.drafter_config)) if v is not None]
        if used:
            ap.error(f"{', '.join(used)}: only the DSpark drafter takes these; mode(s) {','.join(args.mode)} "
                     "draft with the target's MTP head")
    if not args.merge:
        gamma = (args.block_size or PUBLISHED_BLOCK) if args.drafter_config is None else None
        try:
            for m in args.mode:
                if args.nodes is not None and (gamma is not None or uses_mtp(m)):
                    mode_nodes(m, args.nodes, gamma or 0)
        except ValueError as e:
            ap.error(str(e))
    return drive(ap, args, prog="hyspec bench round-scale", merge=merge, sweep=sweep, write=write_outputs,
                 summary=lambda r: summary_table(r) + "\n" + target_line(r), finite=all_finite)


if __name__ == "__main__":
    sys.exit(main())
