"""The slot programs of the request loop besides the speculative round (`hyspec_jax.spec.round`): prefill and
the plain decoding step. Each is jitted once per static shape; state buffers are donated.

Every slot holds one request's committed state (a `TargetState` row; with a drafter also its `DrafterState` row)
and its anchor — the last token the target chose, not processed yet — on the device.

- `ar_prefill` / `spec_prefill`: P rows of prompt chunks [P, T] are run into slots `slots` [P] (index B = a
  padding row, dropped): the slots' rows are gathered (reset for a request's first chunk), extended by the target
  (`spec_prefill`: with the drafter's tap layers, whose features are appended to the slot's drafter context),
  scattered back, and the sampled next token (PRNG step 0) becomes the slot's anchor.
- `ar_step`: one plain decoding step of every slot (inactive slots keep their state and anchor); `spec_step` the
  same beside a drafter, whose context it appends.

Penalties (presence / frequency / repetition): a penalized flavour of each program, run only while a slot's request
has non-neutral ones, takes the backend's per-slot `PenaltyCounts` (donated) and per-row `SlotPenalty` and penalizes
the target's logits before sampling (`sampling.penalize`); prefill resets a first chunk's history and marks the
chunk's tokens seen, a step counts the anchor it processes. Without them (None) the programs are exactly the
unpenalized ones.

Sampling parameters are per-row device arrays (`SlotSampling`) and the PRNG key of a slot is
fold_in(key(seed), step) with the slot's own step counter, so neither the parameters nor the batch composition
trigger a recompile or change a request's samples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.config import TargetConfig
from hyspec_jax.models.drafter import Drafter
from hyspec_jax.models.mtp import MTPHead, MTPState, init_mtp_state
from hyspec_jax.models.target import TargetModel
from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, SlotSampling, sample
from hyspec_jax.state import DrafterState, TargetState, init_drafter_state, init_state

I32 = jnp.int32


def _rows(x: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, idx, axis=axis)


def _reset(x: jax.Array, reset: jax.Array, axis: int) -> jax.Array:
    shape = [1] * x.ndim
    shape[axis] = reset.shape[0]
    return jnp.where(reset.reshape(shape), jnp.zeros_like(x), x)


def _put(full: jax.Array, slots: jax.Array, part: jax.Array, axis: int) -> jax.Array:
    """Write rows back along `axis`; padding rows carry slot index B and are dropped."""
    index = (slice(None),) * axis + (slots,)
    return full.at[index].set(part.astype(full.dtype), mode="drop")


def gather_target(state: TargetState, slots: jax.Array, reset: jax.Array) -> TargetState:
    """The slots' rows; a reset row (a request's first chunk) starts empty — its deferred rows too (zeros: an
    empty ring), so a slot freed mid-ring carries nothing into the next request; `extend` folds the others'."""
    idx = jnp.minimum(slots, state.batch - 1)
    pending = None if state.pending is None else jax.tree.map(
        lambda x: _reset(_rows(x, idx, 1), reset, 1), state.pending)
    return TargetState(ssm=_reset(_rows(state.ssm, idx, 1), reset, 1),
                       conv=_reset(_rows(state.conv, idx, 1), reset, 1),
                       keys=_rows(state.keys, idx, 1), values=_rows(state.values, idx, 1),
                       lengths=jnp.where(reset, 0, _rows(state.lengths, idx, 0)), pending=pending)


def scatter_target(state: TargetState, slots: jax.Array, sub: TargetState) -> TargetState:
    pending = None if state.pending is None else jax.tree.map(
        lambda full, part: _put(full, slots, part, 1), state.pending, sub.pending)
    return TargetState(ssm=_put(state.ssm, slots, sub.ssm, 1), conv=_put(state.conv, slots, sub.conv, 1),
                       keys=_put(state.keys, slots, sub.keys, 1), values=_put(state.values, slots, sub.values, 1),
                       lengths=_put(state.lengths, slots, sub.lengths, 0), pending=pending)


def gather_drafter(dstate: DrafterState | MTPState, slots: jax.Array, reset: jax.Array) -> DrafterState | MTPState:
    idx = jnp.minimum(slots, dstate.batch - 1)
    kw = dict(keys=_rows(dstate.keys, idx, 1), values=_rows(dstate.values, idx, 1),
              lengths=jnp.where(reset, 0, _rows(dstate.lengths, idx, 0)))
    if isinstance(dstate, MTPState):
        return MTPState(hidden=_rows(dstate.hidden, idx, 0), **kw)
    return DrafterState(**kw)


def scatter_drafter(dstate: DrafterState | MTPState, slots: jax.Array, sub: DrafterState | MTPState
                    ) -> DrafterState | MTPState:
    kw = dict(keys=_put(dstate.keys, slots, sub.keys, 1), values=_put(dstate.values, slots, sub.values, 1),
              lengths=_put(dstate.lengths, slots, sub.lengths, 0))
    if isinstance(dstate, MTPState):
        return MTPState(hidden=_put(dstate.hidden, slots, sub.hidden, 0), **kw)
    return DrafterState(**kw)


def gather_rows(rows: jax.Array, state: TargetState, dstate, per_row: tuple):
    """A step over `rows` [R] of the B slots (index B: a padding row — it reads slot B − 1 and is written nowhere):
    the rows of the target state, of the drafter context (None: none) and of every [B, ...] array or pytree of
    them in `per_row` (None entries stay None). The decoding-bucket form of a step (`Backend.decode_buckets`)."""
    keep = jnp.zeros(rows.shape, bool)
    idx = jnp.minimum(rows, state.batch - 1)
    take = lambda x: None if x is None else jax.tree.map(lambda a: _rows(a, idx, 0), x)  # noqa: E731
    return (gather_target(state, rows, keep), None if dstate is None else gather_drafter(dstate, rows, keep),
            tuple(take(x) for x in per_row))


def put_rows(rows: jax.Array, state: TargetState, sub: TargetState, dstate, dsub, per_row: tuple, sub_rows: tuple):
    """`gather_rows` undone: the rows written back into the B slots' state, drafter context and per-row arrays
    (padding rows dropped)."""
    put = lambda full, part: None if full is None else jax.tree.map(  # noqa: E731
        lambda f, p: _put(f, rows, p, 0), full, part)
    return (scatter_target(state, rows, sub), None if dstate is None else scatter_drafter(dstate, rows, dsub),
            tuple(put(f, p) for f, p in zip(per_row, sub_rows)))


def _prefill_penalty(logits: jax.Array, slots: jax.Array, tokens: jax.Array, valid: jax.Array, reset: jax.Array,
                     hist: PenaltyCounts | None, penalty: SlotPenalty | None):
    """Prefill's penalties: (penalized last logits [P, V], updated history or None). The rows' histories (reset
    for a first chunk) get the chunk's tokens as seen; no output is counted yet."""
    if hist is None:
        return logits, None
    idx = jnp.minimum(slots, hist.counts.shape[0] - 1)
    sub = PenaltyCounts(counts=_reset(_rows(hist.counts, idx, 0), reset, 0),
                        seen=_reset(_rows(hist.seen, idx, 0), reset, 0))
    sub = sub.add(tokens, valid, output=False)
    hist = PenaltyCounts(counts=_put(hist.counts, slots, sub.counts, 0), seen=_put(hist.seen, slots, sub.seen, 0))
    return penalty.apply(logits, sub), hist


def _step_penalty(logits: jax.Array, anchor: jax.Array, active: jax.Array, hist: PenaltyCounts | None,
                  penalty: SlotPenalty | None):
    """A decoding step's penalties: the anchor it processes is counted, then logits [B, V] penalized."""
    if hist is None:
        return logits, None
    hist = hist.add(anchor[:, None], active[:, None])
    return penalty.apply(logits, hist), hist


def ar_prefill(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, anchor: jax.Array, slots: jax.Array,
               tokens: jax.Array, valid: jax.Array, reset: jax.Array, sampling: SlotSampling,
               hist: PenaltyCounts | None = None, penalty: SlotPenalty | None = None):
    """Prompt chunks [P, T] into slots [P]: (first tokens [P], state, anchor), then the penalty history when
    penalized (hist: the backend's, penalty: the P rows' parameters). The first token is the warped draw
    of every row (`sample(stochastic=True)`: greedy rows get their argmax), so one program per prefill shape serves
    greedy and sampling requests with no run-time branch."""
    model: TargetModel = nnx.merge(graphdef, params)
    sub = gather_target(state, slots, reset)
    logits, _, sub = model.extend(sub, tokens, valid, last_only=True)
    last, hist = _prefill_penalty(logits[:, 0], slots, tokens, valid, reset, hist, penalty)
    first = sample(last, sampling, jnp.zeros((), I32), stochastic=True)
    out = first, scatter_target(state, slots, sub), _put(anchor, slots, first, 0)
    return out if hist is None else out + (hist,)


def spec_prefill(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                 state: TargetState, dstate: DrafterState, anchor: jax.Array, slots: jax.Array, tokens: jax.Array,
                 valid: jax.Array, reset: jax.Array, sampling: SlotSampling, hist: PenaltyCounts | None = None,
                 penalty: SlotPenalty | None = None, *, tap_layers: tuple[int, ...]):
    """`ar_prefill` that also fills the slots' drafter context with the chunk's tap-layer features:
    (first tokens [P], state, dstate, anchor[, penalty history]). With the MTP head (an `MTPState`): the chunk's
    tokens paired with the target's final-norm hiddens (tap_layers = the last layer)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter | MTPHead = nnx.merge(dgraph, dparams)
    sub = gather_target(state, slots, reset)
    dsub = gather_drafter(dstate, slots, reset)
    logits, taps, sub = target.extend(sub, tokens, valid, last_only=True, tap_layers=tap_layers)
    if isinstance(dsub, MTPState):
        dsub = drafter.append(dsub, target.model.embed_tokens.weight[...], tokens, target.model.norm(taps[0]),
                              jnp.sum(valid, axis=1, dtype=I32))
    else:
        dsub = drafter.append_context(dsub, taps, jnp.sum(valid, axis=1, dtype=I32))
    last, hist = _prefill_penalty(logits[:, 0], slots, tokens, valid, reset, hist, penalty)
    first = sample(last, sampling, jnp.zeros((), I32), stochastic=True)
    out = (first, scatter_target(state, slots, sub), scatter_drafter(dstate, slots, dsub),
           _put(anchor, slots, first, 0))
    return out if hist is None else out + (hist,)


def ar_step(graphdef: nnx.GraphDef, params: nnx.State, state: TargetState, anchor: jax.Array, active: jax.Array,
            sampling: SlotSampling, steps: jax.Array, stochastic: bool | None, hist: PenaltyCounts | None = None,
            penalty: SlotPenalty | None = None, rows: jax.Array | None = None):
    """One decoding step of every active slot: (next anchor [B], state[, penalty history]). stochastic (static):
    False — every active slot greedy, a branch-free argmax program; True — the warped draw (`sampling.sample`).
    rows [R] (R < B): the step runs on those slots only (`gather_rows`; the others are inactive), at the cost of R
    rows — the same tokens, since a slot's randomness is its own (seed, step)."""
    if rows is not None:
        B = anchor.shape[0]
        sub, _, (a, act, samp, st, h, pen) = gather_rows(rows, state, None, (anchor, active, sampling, steps, hist,
                                                                              penalty))
        act = act & (rows < B)
        tok, sub, *h = ar_step(graphdef, params, sub, a, act, samp, st, stochastic, h, pen)
        state, _, (anchor, hist) = put_rows(rows, state, sub, None, None, (anchor, hist), (tok, h[0] if h else None))
        return (anchor, state) if hist is None else (anchor, state, hist)
    model: TargetModel = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, anchor[:, None], active[:, None])
    last, hist = _step_penalty(logits[:, 0], anchor, active, hist, penalty)
    tok = sample(last, sampling, steps, stochastic)
    out = jnp.where(active, tok, anchor), state
    return out if hist is None else out + (hist,)


def spec_step(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
              state: TargetState, dstate: DrafterState | MTPState, anchor: jax.Array, active: jax.Array,
              sampling: SlotSampling, steps: jax.Array, hist: PenaltyCounts | None = None,
              penalty: SlotPenalty | None = None, *, tap_layers: tuple[int, ...], stochastic: bool | None):
    """`ar_step` beside a drafter: one plain decoding step of every active slot that also appends the anchor's
    tap-layer features to the slot's drafter context (as `spec_prefill` does for a chunk), so a later speculative
    round drafts from an up-to-date context. The speculative backends' width-1 round (`spec.width`): plain
    decoding at the decoding step's cost. Returns (next anchor [B], state, dstate[, penalty history])."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter | MTPHead = nnx.merge(dgraph, dparams)
    logits, taps, state = target.extend(state, anchor[:, None], active[:, None], tap_layers=tap_layers)
    n = active.astype(I32)
    if isinstance(dstate, MTPState):
        dstate = drafter.append(dstate, target.model.embed_tokens.weight[...], anchor[:, None],
                                target.model.norm(taps[0]), n)
    else:
        dstate = drafter.append_context(dstate, taps, n)
    last, hist = _step_penalty(logits[:, 0], anchor, active, hist, penalty)
    tok = sample(last, sampling, steps, stochastic)
    out = jnp.where(active, tok, anchor), state, dstate
    return out if hist is None else out + (hist,)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "batch", "kv_len", "dtype", "deferred_rows"))
def new_buffers(tcfg, dcfg, batch: int, kv_len: int, dtype, deferred_rows: int = 0):
    """Empty target state (deferred_rows > 0: with the deferred commit's rings), drafter context (None without a
    drafter; an `MTPState` when dcfg is a TargetConfig: the MTP head's config is the target's) and anchors: one
    dispatch."""
    if dcfg is None:
        dstate = None
    elif isinstance(dcfg, TargetConfig):
        dstate = init_mtp_state(dcfg, batch, kv_len, dtype)
    else:
        dstate = init_drafter_state(dcfg, batch, kv_len, dtype)
    return init_state(tcfg, batch, kv_len, dtype, deferred_rows), dstate, jnp.zeros((batch,), I32)


# Anchors are never donated: in plain decoding the anchor array a step returns is also what the host reads, and the
# loop dispatches the next step before reading it.
ar_prefill_jit = DiskCachedJit(ar_prefill, name="ar_prefill", static_argnames=("graphdef",),
                               donate_argnames=("state", "hist"))
spec_prefill_jit = DiskCachedJit(spec_prefill, name="spec_prefill", static_argnames=("tgraph", "dgraph", "tap_layers"),
                                 donate_argnames=("state", "dstate", "hist"))
ar_step_jit = DiskCachedJit(ar_step, name="ar_step", static_argnames=("graphdef", "stochastic"),
                            donate_argnames=("state", "hist"))
