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

Its inputs and outputs are named pytrees: the donated `SlotState` (target, drafter context, penalty history) beside
the anchors, the per-call `StepInputs`, the phases' `Draft` and `Verified`, and the host's `RoundOutput`. Width 1
(`RoundShape.plain`) is plain decoding, not a round: the request loop's program (`runtime.programs.spec_round_io`)
runs the decoding step `runtime.programs.spec_step` there, which appends the drafter's context. With
`RoundShape.gain_widths` a round also reports, per slot, the drafter's expected accepted drafts at each of those widths (`budget.width_gains`), from which `runtime.width` chooses the width of later rounds.

Everything static about a round is one frozen `RoundShape`, passed to every program and never mutated. The three
phases (`round_draft`, `round_verify`, `round_commit`) are also jitted alone for profiling
(`hyspec_jax.bench.phases`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from hyspec_jax import tree as tree_lib
from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.logprobs import TokenLogprobs, token_logprobs
from hyspec_jax.models.drafter import DraftBlock, Drafter, target_heads
from hyspec_jax.models.target import TargetModel
from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, SlotSampling, penalize_tree, slot_keys
from hyspec_jax.spec.accept import accept
from hyspec_jax.spec.budget import confident_length, packed_gains, root_floor, select_nodes, width_gains
from hyspec_jax.spec.commit import commit
from hyspec_jax.spec.mtp_propose import mtp_chain, mtp_tree
from hyspec_jax.spec.propose import chain_from_block
from hyspec_jax.spec.select import chain_candidates, tree_candidates
from hyspec_jax.state import DrafterState, TargetState, TreeCache
from hyspec_jax.tree import TreeExpansion

I32 = jnp.int32
F32 = jnp.float32


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
    # verify widths whose expected accepted drafts a round reports (`RoundOutput.gains`, `budget.width_gains`; the
    # per-round width choice of `runtime.width` reads them); () = none
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
    # > 0: every committed token's logprob and this many top alternatives, from the target's verify logits
    # (`RoundOutput.logprobs`; the server's --max-logprobs); 0: none computed
    logprobs: int = 0

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


@struct.dataclass
class SlotState:
    """The slots' device state a step reads and writes, donated to it: the target's committed state, the drafter's
    context (None: plain decoding) and the penalty history (None: the unpenalized flavour). The anchors [B] travel
    beside it, never donated: a plain decoding step's anchors are also what the host reads, after the next step
    was dispatched."""
    target: TargetState
    drafter: DrafterState | None = None      # an `MTPState` with the MTP head
    hist: PenaltyCounts | None = None

    @property
    def batch(self) -> int:
        return self.target.batch


@struct.dataclass
class StepInputs:
    """A decoding step's or a round's per-call inputs. The host's int32 values travel as one array (`pack`: each
    host→device transfer costs tens of µs of host time beside a GPU, a visible part of a launch-bound batch-1
    round), read by name through the properties; the rows' sampling and penalty parameters (device arrays made
    once per distinct set)."""
    host: jax.Array                      # [R, 3] int32: active, step, capacity; [R, 4]: then the row's slot
    sampling: SlotSampling
    penalty: SlotPenalty | None = None   # the penalized flavour

    @property
    def active(self) -> jax.Array:
        """[R] bool: the rows that step (padding rows never do)."""
        return self.host[:, 0] > 0

    @property
    def steps(self) -> jax.Array:
        """[R] per-slot step counters (PRNG: a slot's randomness never depends on its neighbours)."""
        return self.host[:, 1]

    @property
    def capacity(self) -> jax.Array:
        """The round's batch-wide node budget (a runtime scalar; unused by plain decoding)."""
        return self.host[0, 2]

    @property
    def rows(self) -> jax.Array | None:
        """[R] the slots a step over R < B rows runs on (B: a padding row), None: every slot (static)."""
        return self.host[:, 3] if self.host.shape[1] > 3 else None

    def over_rows(self, sampling: SlotSampling, penalty: SlotPenalty | None) -> "StepInputs":
        """These inputs for the gathered rows (their sampling and penalty rows given): no slot column."""
        return StepInputs(host=self.host[:, :3], sampling=sampling, penalty=penalty)

    @staticmethod
    def pack(active: np.ndarray, steps: np.ndarray, capacity: int = 0, rows: np.ndarray | None = None) -> np.ndarray:
        """`host` [B, 3] int32 from the slots' active mask and step counters; with rows [R] (slot indices, B =
        padding, inactive), a step over those slots alone: [R, 4], the slots in column 3."""
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


@struct.dataclass
class RoundOutput:
    """What a round tells the host, per slot: slot b committed tokens[b, :count[b]] (its accepted drafts, then the
    bonus token, which is also its new anchor); inactive slots count 0. `pack` / `unpack` move it as one int32
    array (one device→host transfer; floats bit-cast, not scaled)."""
    tokens: jax.Array                 # [B, D + 1]
    count: jax.Array                  # [B]
    accepted: jax.Array               # [B] accepted drafts
    # [B, G] the drafter's expected accepted drafts at each of the G = len(shape.gain_widths) widths (−1: nothing
    # drafted: a plain round); None without gain widths
    gains: jax.Array | None = None
    # [B, D + 1] the target's logprobs of tokens (`RoundShape.logprobs` > 0); None without
    logprobs: TokenLogprobs | None = None

    def pack(self) -> jax.Array:
        """[B, D + 3 + G (+ (D + 1)(1 + 2k))] int32: tokens, count, accepted, the gains' float32 bits, then the
        logprobs (`TokenLogprobs.pack`)."""
        cols = [self.tokens.astype(I32), self.count.astype(I32)[:, None], self.accepted.astype(I32)[:, None]]
        if self.gains is not None:
            cols.append(jax.lax.bitcast_convert_type(self.gains.astype(F32), I32))
        if self.logprobs is not None:
            cols.append(self.logprobs.pack())
        return jnp.concatenate(cols, axis=1)

    @classmethod
    def unpack(cls, host: np.ndarray, gains: int = 0, logprobs: int = 0) -> "RoundOutput":
        """`pack`'s array (host) back into named fields, for a round with `gains` gain widths and `logprobs` top
        alternatives (`RoundShape.logprobs`)."""
        host = np.asarray(host)
        lp = None
        if logprobs:
            n = (host.shape[1] - 2 - gains) // (2 + 2 * logprobs)     # D + 1 (the width: (D + 1)(2 + 2k) + 2 + G)
            cut = host.shape[1] - TokenLogprobs.columns(n, logprobs)
            host, lp = host[:, :cut], TokenLogprobs.unpack(host[:, cut:], logprobs)
        k = host.shape[1] - gains
        g = np.ascontiguousarray(host[:, k:]).view(np.float32).astype(np.float64) if gains else None
        return cls(tokens=host[:, :k - 2], count=host[:, k - 2], accepted=host[:, k - 1], gains=g, logprobs=lp)


@struct.dataclass
class Draft:
    """Round phase 1's result: the [B, N] forest the target verifies."""
    tokens: jax.Array                 # [B, N]
    tree: tree_lib.Tree
    child_q: jax.Array | None         # [B, N, V] each node's draft distribution (sampling); None greedy
    gains: jax.Array | None           # [B, G] expected accepted drafts per gain width; None without gain widths


@struct.dataclass
class Verified:
    """Round phase 2's result: the target's verify over the forest."""
    logits: jax.Array                 # [B, N, V]
    taps: jax.Array                   # [L, B, N, H] the drafter's tap layers (MTP: the final-norm hiddens)
    cache: TreeCache                  # what the commit forms the accepted path's state from
    embed: jax.Array | None = None    # the target's embedding table (the MTP head's commit embeds the path)


def _fold(keys: jax.Array, i: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...] at idx [B, N] -> [B, N, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def round_draft(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                slots: SlotState, anchor: jax.Array, inputs: StepInputs, *, shape: RoundShape) -> Draft:
    """Round phase 1 — draft, build, select (see `spec_round`): the [B, N] forest the target verifies, when
    sampling the draft distribution of each node, and the expected accepted drafts per gain width."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter = nnx.merge(dgraph, dparams)
    heads = target_heads(target)
    samp = inputs.sampling if shape.stochastic else None
    dkeys = _fold(slot_keys(inputs.sampling.seed, inputs.steps), 0) if samp is not None else None

    if shape.drafter == "mtp":
        with jax.named_scope("drafter_forward"):
            if shape.tree is None:
                prop = mtp_chain(drafter, heads, slots.drafter, anchor, shape.gamma, samp, dkeys)
                cand = chain_candidates(prop, anchor, None, samp)
            else:
                cand = mtp_tree(drafter, heads, slots.drafter, anchor, shape.tree, samp, dkeys, shape.kernel_impl)
        return _select(cand, inputs, samp, shape)
    state = slots.target
    ssm, pending = (state.ssm, state.pending) if shape.reader else (None, None)
    with jax.named_scope("drafter_forward"):
        block = drafter.draft(slots.drafter, anchor, heads, ssm,
                              num_slots=shape.gamma,   # the slots a chain / tree reads (no unused LM heads)
                              pending=pending)
    if shape.tree is None:
        G = shape.gamma
        block = DraftBlock(hidden=block.hidden[:, :G], logits=block.logits[:, :G])
        prop = chain_from_block(drafter, block, anchor, samp, dkeys)
        length = (None if shape.confidence_threshold is None
                  else confident_length(prop.confidence, shape.confidence_threshold))
        cand = chain_candidates(prop, anchor, length, samp)
    else:
        with jax.named_scope("tree_build"):
            cand = tree_candidates(drafter, block, anchor, shape.tree, samp, dkeys, kernel_impl=shape.kernel_impl)
    return _select(cand, inputs, samp, shape)


def _select(cand, inputs: StepInputs, samp: SlotSampling | None, shape: RoundShape) -> Draft:
    """The budget's [B, N] forest from the candidates."""
    N, D = shape.verify_nodes, shape.depth
    active, capacity = inputs.active, inputs.capacity
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
    return Draft(tokens=tokens, tree=tree, child_q=child_q, gains=gains)


def round_verify(tgraph: nnx.GraphDef, tparams: nnx.State, state: TargetState, draft: Draft, *,
                 shape: RoundShape) -> Verified:
    """Round phase 2 — the target's verify forward over the forest."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    logits, taps, cache = target.verify(state, draft.tree, draft.tokens, method=shape.method,
                                        tap_layers=shape.tap_layers, kernel_impl=shape.kernel_impl,
                                        packed_rows=shape.packed_rows)
    embed = None
    if shape.drafter == "mtp":   # the head reads the hidden after the target's final norm, and embeds the path
        taps = target.model.norm(taps)
        embed = target.model.embed_tokens.weight[...]
    return Verified(logits=logits, taps=taps, cache=cache, embed=embed)


def round_commit(dgraph: nnx.GraphDef, dparams: nnx.State, slots: SlotState, anchor: jax.Array, inputs: StepInputs,
                 draft: Draft, verified: Verified, *, shape: RoundShape
                 ) -> tuple[SlotState, jax.Array, RoundOutput]:
    """Round phase 3 — accept, then commit target and drafter: `spec_round`'s return value. Penalized (slots.hist
    and inputs.penalty given): the anchor is counted, the target's logits at every node penalized with its own
    path's history (`penalize_tree`; greedy and sampling acceptance alike, so the round stays lossless w.r.t.
    penalized plain decoding), the accepted drafts counted."""
    drafter: Drafter = nnx.merge(dgraph, dparams)
    B = anchor.shape[0]
    D = shape.depth
    active, tokens, tree, hist = inputs.active, draft.tokens, draft.tree, slots.hist
    samp = inputs.sampling if shape.stochastic else None
    akeys = _fold(slot_keys(inputs.sampling.seed, inputs.steps), 1) if samp is not None else None
    logits = verified.logits
    raw = logits              # the reported logprobs are the raw target's (`hyspec_jax.logprobs`)
    if hist is not None:
        hist = hist.add(anchor[:, None], active[:, None])
        logits = penalize_tree(logits, tokens, tree, hist, inputs.penalty)
    acc = accept(logits, tokens, tree, draft.child_q, samp, akeys, max_children=shape.max_children)

    node = jnp.where(active, acc.node, -1)
    new_state = commit(slots.target, verified.cache, tree, node, shape.kernel_impl)
    path, length = tree_lib.path_to(tree, node)                                   # [B, D+1], [B]
    src = jnp.maximum(path, 0)
    path_taps = jnp.take_along_axis(verified.taps, src[None, :, :, None], axis=2)  # [L, B, D+1, H]
    path_tokens = jnp.take_along_axis(tokens, src, axis=1)                        # anchor, accepted drafts
    if shape.drafter == "mtp":
        new_dstate = drafter.append(slots.drafter, verified.embed, path_tokens, path_taps[0], length)
    else:
        new_dstate = drafter.append_context(slots.drafter, path_taps, length)

    m = acc.num_accepted
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), I32)], axis=1)
    out = jnp.where(jnp.arange(D + 1)[None] == m[:, None], acc.bonus[:, None], out)
    if hist is not None:
        hist = hist.add(path_tokens[:, 1:], (jnp.arange(D)[None] < m[:, None]) & active[:, None])
    lps = None
    if shape.logprobs:        # emitted token j was chosen at path node j (the anchor's, then each accepted draft's)
        lps = token_logprobs(jnp.take_along_axis(raw, src[:, :, None], axis=1), out, shape.logprobs)
    result = RoundOutput(tokens=out, count=jnp.where(active, m + 1, 0), accepted=m, gains=draft.gains,
                         logprobs=lps)
    return (SlotState(target=new_state, drafter=new_dstate, hist=hist), jnp.where(active, acc.bonus, anchor),
            result)


def spec_round(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
               slots: SlotState, anchor: jax.Array, inputs: StepInputs, *, shape: RoundShape
               ) -> tuple[SlotState, jax.Array, RoundOutput]:
    """One speculative round for every slot: (slots, anchor [B], `RoundOutput`). Inactive slots are untouched
    (count 0). A drafting width only: width 1 (`RoundShape.plain`) is the decoding step
    `runtime.programs.spec_step`, which the request loop's program runs in its place.

    The three phases are `round_draft` → `round_verify` → `round_commit` (composed here into one program;
    `hyspec_jax.bench.phases.phase_times` jits and times them one by one).
    """
    if shape.plain:
        raise ValueError("a width-1 round is plain decoding: runtime.programs.spec_step runs it")
    # named scopes: each phase's kernels carry its name in profiles and in the compiled HLO's op names
    with jax.named_scope("draft"):
        draft = round_draft(tgraph, tparams, dgraph, dparams, slots, anchor, inputs, shape=shape)
    with jax.named_scope("verify"):
        verified = round_verify(tgraph, tparams, slots.target, draft, shape=shape)
    with jax.named_scope("commit"):
        return round_commit(dgraph, dparams, slots, anchor, inputs, draft, verified, shape=shape)


# the named scopes of `spec_round` (`hyspec_jax.bench.phases.round_kernels` counts kernels by them)
ROUND_SCOPES = ("draft/drafter_forward", "draft/tree_build", "draft", "verify", "commit")

spec_round_jit = DiskCachedJit(spec_round, name="spec_round", static_argnames=("tgraph", "dgraph", "shape"),
                               donate_argnames=("slots",))
# the phases jitted alone (`hyspec_jax.bench.phases.phase_times`); the commit donates the states as the fused round does
round_draft_jit = jax.jit(round_draft, static_argnames=("tgraph", "dgraph", "shape"))
round_verify_jit = jax.jit(round_verify, static_argnames=("tgraph", "shape"))
round_commit_jit = jax.jit(round_commit, static_argnames=("dgraph", "shape"), donate_argnames=("slots",))

