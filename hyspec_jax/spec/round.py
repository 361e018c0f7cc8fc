"""The speculative round: draft → select → verify → accept → commit, one jitted program per bucket (docs/design.md §2).

Per slot the device holds the target's committed state (`TargetState`), the drafter's context K/V
(`DrafterState`, same committed length) and the anchor — the last token the target chose, not processed yet.
One round (`spec_round`, compiled once per bucket: batch slots B, verify width N, KV length S; state donated):

  draft    one DSpark block from the context K/V + anchor (`ready` modes: the reader reads TargetState.ssm);
           `mtp` modes: the target's MTP head, step by step (`spec.mtp_propose`), from its own K/V cache
  build    chain [anchor, x₀..x_{γ−1}] (optionally cut by DSpark's confidence) or a beam tree (`spec.select`)
  select   Bole's batch-shared budget: anchor + root child of every active slot, then the batch-wide best
           scores, ≤ N per row, ≤ C in all (`spec.budget.select_nodes`); compacted to a [B, N] forest
  verify   one target forward over the forest from the committed state, with the drafter's tap layers (with a
           budget C below B·N on C packed rows, `RoundShape.packed_rows`)
  accept   greedy matching or lossless recursive rejection sampling (`spec.accept`)
  commit   target: factorized commit of the root-to-accepted path (`spec.commit.commit`); drafter: context
           K/V of the path's target taps (anchor + accepted drafts) appended (MTP: the path's tokens paired with
           the target's final-norm hiddens, `MTPHead.append`); next anchor = the bonus token.

Width 1 (`RoundShape.plain`) is plain decoding: one decoding step that appends the drafter's context, nothing
drafted. With `RoundShape.gain_widths` a round also reports, per slot, the drafter's expected accepted drafts at each
of those widths (`budget.width_gains`), from which `spec.width` chooses the width of later rounds.

Everything static about a round is one frozen `RoundShape`, passed to every program and never mutated. The three
phases (`round_draft`, `round_verify`, `round_commit`) are also jitted alone for profiling
(`hyspec_jax.bench.phases`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax import tree as tree_lib
from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.models.drafter import DraftBlock, Drafter, target_heads
from hyspec_jax.models.target import TargetModel
from hyspec_jax.runtime.programs import gather_rows, put_rows, spec_step
from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, SlotSampling, penalize_tree, slot_keys
from hyspec_jax.spec.accept import accept
from hyspec_jax.spec.budget import confident_length, packed_gains, root_floor, select_nodes, width_gains
from hyspec_jax.spec.commit import commit
from hyspec_jax.spec.mtp_propose import mtp_candidates
from hyspec_jax.spec.propose import chain_from_block
from hyspec_jax.spec.select import chain_candidates, tree_candidates
from hyspec_jax.state import DrafterState, TargetState
from hyspec_jax.tree import TreeExpansion

I32 = jnp.int32
GAIN_SCALE = 1000   # host_out carries expected accepted drafts in thousandths (one int32 array each way)


@dataclasses.dataclass(frozen=True)
class RoundShape:
    """Static part of a compiled round (hashable)."""
    tree: TreeExpansion | None  # None = chain
    gamma: int                  # chain drafts
    verify_nodes: int           # N
    reader: bool
    stochastic: bool            # False: every slot greedy (no draft distributions are kept)
    confidence_threshold: float | None
    method: str
    tap_layers: tuple[int, ...]
    kernel_impl: str = "reference"
    drafter: str = "dspark"     # "dspark": a DSpark block drafter; "mtp": the target's own MTP head
                                # (tap_layers then = the last layer, whose final-norm output feeds the head)
    # verify widths whose expected accepted drafts `spec_round_io` reports (`budget.width_gains`; the
    # per-round width choice of `spec.width` reads them); () = none
    gain_widths: tuple[int, ...] = ()
    # > 0: the verify's row-wise work on the selected nodes packed into this many rows (`budget.packed_rows`), the
    # round's batch-wide capacity capped to it; 0: the dense [B, N] forest
    packed_rows: int = 0
    # the gain widths are packed widths (`budget.packed_gains`: width w = a batch-wide budget of slots · w nodes at
    # row capacity verify_nodes) instead of per-row widths (`budget.width_gains`)
    packed_gains: bool = False
    # False: the round's batch-wide capacity is at least slots · N (no user budget C), so it never binds and each row's
    # nodes are ranked within the row alone (`budget.select_nodes(batch_capacity=False)`: no batch-wide sort)
    batch_budget: bool = True

    def __post_init__(self) -> None:
        if self.packed_rows and not self.batch_budget:
            raise ValueError("a packed round selects under its batch-wide budget: batch_budget must be True")

    @property
    def plain(self) -> bool:
        """Width 1: plain decoding — no draft, one decoding step (`runtime.programs.spec_step`) that still
        appends the drafter's context from the target's taps, so a later round drafts from an up-to-date
        context."""
        return self.verify_nodes == 1

    @property
    def depth(self) -> int:
        d = self.tree.depth if self.tree is not None else self.gamma
        return max(0, min(d, self.verify_nodes - 1))

    @property
    def max_children(self) -> int:
        return self.tree.top_k if self.tree is not None else 1


def _fold(keys: jax.Array, i: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...] at idx [B, N] -> [B, N, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def round_draft(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                state: TargetState, dstate: DrafterState, anchor: jax.Array, active: jax.Array,
                sampling: SlotSampling, steps: jax.Array, capacity: jax.Array, *, shape: RoundShape):
    """Round phase 1 — draft, build, select (see `spec_round`): (tokens [B, N], tree, child_q [B, N, …] or
    None) — the [B, N] forest the target verifies and, when sampling, the draft distribution of each node."""
    return _draft(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active, sampling, steps, capacity,
                  shape=shape)[:3]


def _draft(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active, sampling, steps, capacity, *,
           shape: RoundShape):
    """`round_draft`, and the expected accepted drafts [B, len(shape.gain_widths)] (None without gain widths)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter = nnx.merge(dgraph, dparams)
    heads = target_heads(target)
    samp = sampling if shape.stochastic else None
    dkeys = _fold(slot_keys(sampling.seed, steps), 0)

    if shape.drafter == "mtp":
        with jax.named_scope("drafter_forward"):
            cand = mtp_candidates(drafter, heads, dstate, anchor, shape.tree, shape.gamma, samp,
                                  dkeys if samp is not None else None, kernel_impl=shape.kernel_impl)
        return _select(cand, active, capacity, samp, shape)
    ssm, pending = (state.ssm, state.pending) if shape.reader else (None, None)
    with jax.named_scope("drafter_forward"):
        block = drafter.draft(dstate, anchor, heads, ssm,
                              num_slots=shape.gamma,   # the slots a chain / tree reads (no unused LM heads)
                              pending=pending)
    if shape.tree is None:
        G = shape.gamma
        block = DraftBlock(hidden=block.hidden[:, :G], logits=block.logits[:, :G])
        prop = chain_from_block(drafter, block, anchor, samp, dkeys if samp is not None else None)
        length = (None if shape.confidence_threshold is None
                  else confident_length(prop.confidence, shape.confidence_threshold))
        cand = chain_candidates(prop, anchor, length, samp)
    else:
        with jax.named_scope("tree_build"):
            cand = tree_candidates(drafter, block, anchor, shape.tree, samp, dkeys if samp is not None else None,
                                   kernel_impl=shape.kernel_impl)
    return _select(cand, active, capacity, samp, shape)


def _select(cand, active: jax.Array, capacity: jax.Array, samp: SlotSampling | None, shape: RoundShape):
    """The budget's [B, N] forest from the candidates: (tokens, tree, child_q or None, gains or None)."""
    N, D = shape.verify_nodes, shape.depth
    valid = cand.valid & active[:, None]
    gains = None
    if shape.gain_widths:
        gains = (packed_gains(cand.score, valid, active, shape.gain_widths, N) if shape.packed_gains
                 else width_gains(cand.score, valid, active, shape.gain_widths))
    forced = root_floor(cand.score, cand.parent, valid, active)
    if shape.packed_rows:      # the packed verify computes packed_rows rows: never select more
        capacity = jnp.minimum(capacity, shape.packed_rows)
    sel = select_nodes(cand.score, cand.parent, cand.depth, valid, forced, N, capacity,
                       batch_capacity=shape.batch_budget)
    tokens = jnp.where(sel.valid, jnp.take_along_axis(cand.token, sel.index, axis=1), 0)
    tree = tree_lib.Tree(parent=sel.parent, valid=sel.valid, depth=sel.depth,
                         envelope=tree_lib.TreeShape(N, D))
    child_q = None if samp is None else _gather(cand.child_q, sel.index)
    return tokens, tree, child_q, gains


def round_verify(tgraph: nnx.GraphDef, tparams: nnx.State, state: TargetState, tree: tree_lib.Tree,
                 tokens: jax.Array, *, shape: RoundShape):
    """Round phase 2 — the target's verify forward over the forest: (logits, taps, TreeCache)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    logits, taps, cache = target.verify(state, tree, tokens, method=shape.method, tap_layers=shape.tap_layers,
                                        kernel_impl=shape.kernel_impl, packed_rows=shape.packed_rows)
    if shape.drafter == "mtp":   # the head reads the hidden after the target's final norm
        taps = target.model.norm(taps)
    return logits, taps, cache


def round_commit(dgraph: nnx.GraphDef, dparams: nnx.State, state: TargetState, dstate: DrafterState,
                 anchor: jax.Array, active: jax.Array, sampling: SlotSampling, steps: jax.Array,
                 tokens: jax.Array, tree: tree_lib.Tree, child_q: jax.Array | None, logits: jax.Array,
                 taps: jax.Array, cache, embed: jax.Array | None = None, hist: PenaltyCounts | None = None,
                 penalty: SlotPenalty | None = None, *, shape: RoundShape):
    """Round phase 3 — accept, then commit target and drafter: `spec_round`'s return value (then the updated
    penalty history when hist is given). embed: the target's embedding table (the MTP head's commit embeds the
    accepted path; unused by DSpark). hist / penalty: the penalized flavour — the anchor is counted, the target's
    logits at every node penalized with its own path's history (`penalize_tree`; greedy and sampling acceptance
    alike, so the round stays lossless w.r.t. penalized plain decoding), the accepted drafts counted."""
    drafter: Drafter = nnx.merge(dgraph, dparams)
    B = anchor.shape[0]
    D = shape.depth
    samp = sampling if shape.stochastic else None
    akeys = _fold(slot_keys(sampling.seed, steps), 1)
    if hist is not None:
        hist = hist.add(anchor[:, None], active[:, None])
        logits = penalize_tree(logits, tokens, tree, hist, penalty)
    acc = accept(logits, tokens, tree.parent, tree.valid, child_q, samp, akeys if samp is not None else None,
                 max_depth=D, max_children=shape.max_children)

    node = jnp.where(active, acc.node, -1)
    new_state = commit(state, cache, tree, node, shape.kernel_impl)
    path, length = tree_lib.path_to(tree, node)                                   # [B, D+1], [B]
    src = jnp.maximum(path, 0)
    path_taps = jnp.take_along_axis(taps, src[None, :, :, None], axis=2)          # [L, B, D+1, H]
    path_tokens = jnp.take_along_axis(tokens, src, axis=1)                        # anchor, accepted drafts
    if shape.drafter == "mtp":
        new_dstate = drafter.append(dstate, embed, path_tokens, path_taps[0], length)
    else:
        new_dstate = drafter.append_context(dstate, path_taps, length)

    m = acc.num_accepted
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), I32)], axis=1)
    out = jnp.where(jnp.arange(D + 1)[None] == m[:, None], acc.bonus[:, None], out)
    count = jnp.where(active, m + 1, 0)
    res = new_state, new_dstate, jnp.where(active, acc.bonus, anchor), out, count, m
    if hist is None:
        return res
    drafts = path_tokens[:, 1:]
    return res + (hist.add(drafts, (jnp.arange(D)[None] < m[:, None]) & active[:, None]),)


def spec_round(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
               state: TargetState, dstate: DrafterState, anchor: jax.Array, active: jax.Array,
               sampling: SlotSampling, steps: jax.Array, capacity: jax.Array, *, shape: RoundShape):
    """One speculative round for every slot. Returns (state, dstate, anchor, tokens [B, D+1], count [B],
    accepted [B]): slot b committed tokens[b, :count[b]] (its accepted drafts, then the bonus token, which is
    also the new anchor). Inactive slots are untouched (count 0).

    steps [B]: per-slot round counters (PRNG: a slot's randomness never depends on its neighbours);
    capacity: batch-wide node budget (runtime scalar).

    The three phases are `round_draft` → `round_verify` → `round_commit` (composed here into one program;
    `hyspec_jax.bench.phases.phase_times` jits and times them one by one).
    """
    return _round(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active, sampling, steps, capacity,
                  shape=shape)[:6]


def _round(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active, sampling, steps, capacity,
           hist=None, penalty=None, *, shape: RoundShape):
    """`spec_round`'s outputs, then the expected accepted drafts per gain width (None without gain widths), then
    the updated penalty history (None unpenalized)."""
    if shape.plain:   # width 1: a plain decoding step (nothing drafted, so no gains: −1)
        B = anchor.shape[0]
        bonus, state, dstate, *h = spec_step(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active,
                                             sampling, steps, hist, penalty, tap_layers=shape.tap_layers,
                                             stochastic=shape.stochastic)
        gains = jnp.full((B, len(shape.gain_widths)), -1.0, jnp.float32) if shape.gain_widths else None
        return (state, dstate, bonus, bonus[:, None], active.astype(I32), jnp.zeros((B,), I32), gains,
                h[0] if h else None)
    # named scopes: each phase's kernels carry its name in profiles and in the compiled HLO's op names
    with jax.named_scope("draft"):
        tokens, tree, child_q, gains = _draft(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active,
                                              sampling, steps, capacity, shape=shape)
    with jax.named_scope("verify"):
        logits, taps, cache = round_verify(tgraph, tparams, state, tree, tokens, shape=shape)
    embed = None
    if shape.drafter == "mtp":
        embed = nnx.merge(tgraph, tparams).model.embed_tokens.weight[...]
    with jax.named_scope("commit"):
        res = round_commit(dgraph, dparams, state, dstate, anchor, active, sampling, steps, tokens, tree, child_q,
                           logits, taps, cache, embed, hist, penalty, shape=shape)
    return res[:6] + (gains, res[6] if hist is not None else None)


def spec_round_io(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                  state: TargetState, dstate: DrafterState, anchor: jax.Array, sampling: SlotSampling,
                  host_in: jax.Array, hist: PenaltyCounts | None = None, penalty: SlotPenalty | None = None, *,
                  shape: RoundShape):
    """`spec_round` with its per-round host inputs packed in one int32 array and its host outputs in another, so
    a round moves one array each way (each transfer costs tens of µs of host time beside a GPU: a visible part
    of a launch-bound batch-1 round). host_in [B, 3]: active (0/1), steps, capacity (read from row 0). Returns (state, dstate, anchor, host_out [B, G + D + 3]: the expected
    accepted drafts at each of the G = len(shape.gain_widths) widths in units of 1/GAIN_SCALE (−1: not
    drafted), then the committed tokens [D + 1], count, accepted); penalized (hist, penalty given): then the
    updated penalty history.

    host_in of R < B rows [R, 4] (`pack_round_inputs(rows=...)`): column 3 is each row's slot (B: padding),
    and the round runs on those R slots alone (`programs.gather_rows`; host_out then has R rows, in that
    order) — the same tokens as the round over all B slots, at the cost of R."""
    B = anchor.shape[0]
    if host_in.shape[0] != B:
        rows = host_in[:, 3]
        sub, dsub, (a, samp, h, pen) = gather_rows(rows, state, dstate, (anchor, sampling, hist, penalty))
        sub, dsub, bonus, host_out, *h = spec_round_io(tgraph, tparams, dgraph, dparams, sub, dsub, a, samp,
                                                       host_in[:, :3], h, pen, shape=shape)   # padding: active 0
        state, dstate, (anchor, hist) = put_rows(rows, state, sub, dstate, dsub, (anchor, hist),
                                                 (bonus, h[0] if h else None))
        out = state, dstate, anchor, host_out
        return out if hist is None else out + (hist,)
    state, dstate, anchor, toks, count, acc, gains, hist = _round(
        tgraph, tparams, dgraph, dparams, state, dstate, anchor, host_in[:, 0] > 0, sampling, host_in[:, 1],
        host_in[0, 2], hist, penalty, shape=shape)
    cols = [toks.astype(I32), count.astype(I32)[:, None], acc.astype(I32)[:, None]]
    if gains is not None:
        cols.insert(0, jnp.round(gains * GAIN_SCALE).astype(I32))
    out = state, dstate, anchor, jnp.concatenate(cols, axis=1)
    return out if hist is None else out + (hist,)


def pack_round_inputs(active: np.ndarray, steps: np.ndarray, capacity: int,
                      rows: np.ndarray | None = None) -> np.ndarray:
    """`spec_round_io`'s host_in [B, 3] int32; with rows [R] (slot indices, B = padding, inactive), the round
    over those slots alone: [R, 4], the slots in column 3."""
    B = len(active)
    if rows is not None:
        pick = np.minimum(rows, B - 1)
        active = np.where(rows < B, np.asarray(active)[pick], 0)
        steps = np.asarray(steps)[pick]
    host = np.empty((len(active), 3 if rows is None else 4), np.int32)
    host[:, 0], host[:, 1], host[:, 2] = active, steps, capacity
    if rows is not None:
        host[:, 3] = rows
    return host


def unpack_round_outputs(host_out: np.ndarray, gains: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [B, D + 1], count [B], accepted [B]) from `spec_round_io`'s host_out of a round with `gains` gain
    widths (a round over some rows: `spread_rows` first)."""
    return host_out[:, gains:-2], host_out[:, -2], host_out[:, -1]


def unpack_round_gains(host_out: np.ndarray, gains: int) -> np.ndarray:
    """The expected accepted drafts [B, gains] (fp, −1: not drafted) from `spec_round_io`'s host_out."""
    g = host_out[:, :gains].astype(np.float64)
    return np.where(g < 0, -1.0, g / GAIN_SCALE)


def spread_rows(host_out: np.ndarray, rows: np.ndarray | None, slots: int) -> np.ndarray:
    """host_out of a round over `rows` as the [slots, ...] host_out of the whole batch (the other slots, all
    inactive: zeros); unchanged without rows."""
    if rows is None:
        return host_out
    full = np.zeros((slots, host_out.shape[1]), host_out.dtype)
    real = rows < slots
    full[rows[real]] = host_out[real]
    return full


# the named scopes of `spec_round` (`hyspec_jax.bench.phases.round_kernels` counts kernels by them)
ROUND_SCOPES = ("draft/drafter_forward", "draft/tree_build", "draft", "verify", "commit")

spec_round_jit = DiskCachedJit(spec_round, name="spec_round", static_argnames=("tgraph", "dgraph", "shape"),
                               donate_argnames=("state", "dstate"))
spec_round_io_jit = DiskCachedJit(spec_round_io, name="spec_round_io", static_argnames=("tgraph", "dgraph", "shape"),
                                  donate_argnames=("state", "dstate", "hist"))
# the phases jitted alone (`hyspec_jax.bench.phases.phase_times`); the commit donates the states as the fused round does
round_draft_jit = jax.jit(round_draft, static_argnames=("tgraph", "dgraph", "shape"))
round_verify_jit = jax.jit(round_verify, static_argnames=("tgraph", "shape"))
round_commit_jit = jax.jit(round_commit, static_argnames=("dgraph", "shape"), donate_argnames=("state", "dstate"))

