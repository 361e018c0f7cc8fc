"""The slot programs of the request loop: prefill, the plain decoding step, and the round's program around the
pure round (`hyspec_jax.spec.round`). Each is jitted once per static shape; the slot state is donated.

Every slot holds one request's committed state (a `TargetState` row; with a drafter also its `DrafterState` row;
penalized, its `PenaltyCounts` row: one `SlotState`) and its anchor — the last token the target chose, not processed
yet — on the device. A program's inputs are named pytrees: a prefill's `PrefillChunk`, a step's or round's
`StepInputs`.

- `ar_prefill` / `spec_prefill`: P rows of prompt chunks [P, T] are run into slots `slots` [P] (index B = a
  padding row, dropped): the slots' rows are gathered (reset for a request's first chunk), extended by the target
  (`spec_prefill`: with the drafter's tap layers, whose features are appended to the slot's drafter context),
  scattered back, and the sampled next token (PRNG step 0) becomes the slot's anchor.
- `ar_step`: one plain decoding step of every slot (inactive slots keep their state and anchor); `spec_step` the
  same beside a drafter, whose context it appends (the width-1 round).
- `spec_round_io`: the round the backends launch — over a decoding bucket's rows (`gather_rows` / `put_rows`),
  `spec_step` at width 1, else `spec.round.spec_round`, its `RoundOutput` packed for one transfer.

Penalties (presence / frequency / repetition): a penalized flavour of each program, run only while a slot's request
has non-neutral ones, takes the backend's per-slot `PenaltyCounts` (`SlotState.hist`, donated) and per-row
`SlotPenalty` (in the inputs) and penalizes
the target's logits before sampling (`sampling.penalize`); prefill resets a first chunk's history and marks the
chunk's tokens seen, a step counts the anchor it processes. Without them (None) the programs are exactly the
unpenalized ones.

Logprobs: with a static `logprobs` = k > 0 (the server's --max-logprobs; `RoundShape.logprobs` for the round and
the width-1 step) every program also returns the logprob and the top-k alternatives of each token it emits
(`hyspec_jax.logprobs.token_logprobs` of the raw logits it chose the token from), packed beside the tokens
(`first_out`, `RoundOutput`): the same programs, no flavour of their own; k = 0 computes nothing.

Sampling parameters are per-row device arrays (`SlotSampling`) and the PRNG key of a slot is
fold_in(key(seed), step) with the slot's own step counter, so neither the parameters nor the batch composition
trigger a recompile or change a request's samples.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.config import TargetConfig
from hyspec_jax.logprobs import TokenLogprobs, token_logprobs
from hyspec_jax.models.drafter import Drafter
from hyspec_jax.models.mtp import MTPHead, MTPState, init_mtp_state
from hyspec_jax.models.target import TargetModel
from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, SlotSampling, sample
from hyspec_jax.spec.round import RoundOutput, RoundShape, SlotState, StepInputs, spec_round
from hyspec_jax.state import DrafterState, TargetState, init_drafter_state, init_state

I32 = jnp.int32


@struct.dataclass
class PrefillChunk:
    """A prefill call's inputs: P rows of prompt chunks [P, T] run into slots `slots` [P] (index B: a padding row,
    dropped); `reset` [P]: a request's first chunk (its slot starts empty); the rows' sampling and penalty
    parameters (penalty None: the unpenalized flavour)."""
    slots: jax.Array           # [P] int32
    tokens: jax.Array          # [P, T] int32
    valid: jax.Array           # [P, T] bool
    reset: jax.Array           # [P] bool
    sampling: SlotSampling
    penalty: SlotPenalty | None = None


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    """Static part of a speculative backend's prefill (hashable): the target's tap layers whose features fill the
    drafter's context, and the top alternatives the first tokens' logprobs carry (`first_out`; 0: none)."""
    tap_layers: tuple[int, ...]
    logprobs: int = 0


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


def gather_rows(rows: jax.Array, slots: SlotState, per_row: tuple) -> tuple[SlotState, tuple]:
    """A step over `rows` [R] of the B slots (index B: a padding row — it reads slot B − 1 and is written nowhere):
    the rows of the slot state (target, drafter context, penalty history; None parts stay None) and of every
    [B, ...] array or pytree of them in `per_row` (None entries stay None). The decoding-bucket form of a step
    (`Backend.decode_buckets`)."""
    keep = jnp.zeros(rows.shape, bool)
    idx = jnp.minimum(rows, slots.batch - 1)
    take = lambda x: None if x is None else jax.tree.map(lambda a: _rows(a, idx, 0), x)  # noqa: E731
    sub = SlotState(target=gather_target(slots.target, rows, keep),
                    drafter=None if slots.drafter is None else gather_drafter(slots.drafter, rows, keep),
                    hist=take(slots.hist))
    return sub, tuple(take(x) for x in per_row)


def put_rows(rows: jax.Array, slots: SlotState, sub: SlotState, per_row: tuple, sub_rows: tuple
             ) -> tuple[SlotState, tuple]:
    """`gather_rows` undone: the rows written back into the B slots' state and per-row arrays (padding rows
    dropped)."""
    put = lambda full, part: None if full is None else jax.tree.map(  # noqa: E731
        lambda f, p: _put(f, rows, p, 0), full, part)
    out = SlotState(target=scatter_target(slots.target, rows, sub.target),
                    drafter=None if slots.drafter is None else scatter_drafter(slots.drafter, rows, sub.drafter),
                    hist=put(slots.hist, sub.hist))
    return out, tuple(put(f, p) for f, p in zip(per_row, sub_rows))


def _prefill_penalty(logits: jax.Array, chunk: PrefillChunk, hist: PenaltyCounts | None):
    """Prefill's penalties: (penalized last logits [P, V], updated history or None). The rows' histories (reset
    for a first chunk) get the chunk's tokens as seen; no output is counted yet."""
    if hist is None:
        return logits, None
    slots, reset = chunk.slots, chunk.reset
    idx = jnp.minimum(slots, hist.counts.shape[0] - 1)
    sub = PenaltyCounts(counts=_reset(_rows(hist.counts, idx, 0), reset, 0),
                        seen=_reset(_rows(hist.seen, idx, 0), reset, 0))
    sub = sub.add(chunk.tokens, chunk.valid, output=False)
    hist = PenaltyCounts(counts=_put(hist.counts, slots, sub.counts, 0), seen=_put(hist.seen, slots, sub.seen, 0))
    return chunk.penalty.apply(logits, sub), hist


def _step_penalty(logits: jax.Array, anchor: jax.Array, inputs: StepInputs, hist: PenaltyCounts | None):
    """A decoding step's penalties: the anchor it processes is counted, then logits [B, V] penalized."""
    if hist is None:
        return logits, None
    hist = hist.add(anchor[:, None], inputs.active[:, None])
    return inputs.penalty.apply(logits, hist), hist


def first_out(first: jax.Array, logits: jax.Array, logprobs: int) -> jax.Array:
    """What a prefill tells the host: the first tokens [P]; with logprobs = k > 0, [P, 1 + 1 + 2k] int32 — each
    token, then its `TokenLogprobs` under the raw logits [P, V] it was drawn from (`read_first` undoes it)."""
    if not logprobs:
        return first
    return jnp.concatenate([first[:, None], token_logprobs(logits[:, None], first[:, None], logprobs).pack()], 1)


def read_first(host: np.ndarray) -> tuple[np.ndarray, TokenLogprobs | None]:
    """`first_out`'s array (host) back: the first tokens [P] and their logprobs (None without)."""
    host = np.asarray(host)
    if host.ndim == 1:
        return host, None
    return host[:, 0], TokenLogprobs.unpack(host[:, 1:], (host.shape[1] - 2) // 2)


def ar_prefill(graphdef: nnx.GraphDef, params: nnx.State, slots: SlotState, anchor: jax.Array, chunk: PrefillChunk,
               *, logprobs: int = 0) -> tuple[jax.Array, SlotState, jax.Array]:
    """Prompt chunks [P, T] into their slots: (first tokens [P] as `first_out` packs them, slots, anchor);
    penalized (slots.hist and chunk.penalty given) the history updated too. The first token is the warped draw of
    every row (`sample(stochastic=True)`: greedy rows get their argmax), so one program per prefill shape serves
    greedy and sampling requests with no run-time branch."""
    model: TargetModel = nnx.merge(graphdef, params)
    sub = gather_target(slots.target, chunk.slots, chunk.reset)
    logits, _, sub = model.extend(sub, chunk.tokens, chunk.valid, last_only=True)
    last, hist = _prefill_penalty(logits[:, 0], chunk, slots.hist)
    first = sample(last, chunk.sampling, jnp.zeros((), I32), stochastic=True)
    out = slots.replace(target=scatter_target(slots.target, chunk.slots, sub), hist=hist)
    return first_out(first, logits[:, 0], logprobs), out, _put(anchor, chunk.slots, first, 0)


def spec_prefill(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                 slots: SlotState, anchor: jax.Array, chunk: PrefillChunk, *, shape: PrefillShape
                 ) -> tuple[jax.Array, SlotState, jax.Array]:
    """`ar_prefill` that also fills the slots' drafter context with the chunk's features at shape.tap_layers. With
    the MTP head (an `MTPState`): the chunk's tokens paired with the target's final-norm hiddens (tap_layers = the
    last layer)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter | MTPHead = nnx.merge(dgraph, dparams)
    sub = gather_target(slots.target, chunk.slots, chunk.reset)
    dsub = gather_drafter(slots.drafter, chunk.slots, chunk.reset)
    logits, taps, sub = target.extend(sub, chunk.tokens, chunk.valid, last_only=True, tap_layers=shape.tap_layers)
    n = jnp.sum(chunk.valid, axis=1, dtype=I32)
    if isinstance(dsub, MTPState):
        dsub = drafter.append(dsub, target.model.embed_tokens.weight[...], chunk.tokens, target.model.norm(taps[0]), n)
    else:
        dsub = drafter.append_context(dsub, taps, n)
    last, hist = _prefill_penalty(logits[:, 0], chunk, slots.hist)
    first = sample(last, chunk.sampling, jnp.zeros((), I32), stochastic=True)
    out = SlotState(target=scatter_target(slots.target, chunk.slots, sub),
                    drafter=scatter_drafter(slots.drafter, chunk.slots, dsub), hist=hist)
    return first_out(first, logits[:, 0], shape.logprobs), out, _put(anchor, chunk.slots, first, 0)


def ar_step(graphdef: nnx.GraphDef, params: nnx.State, slots: SlotState, anchor: jax.Array, inputs: StepInputs, *,
            stochastic: bool | None, logprobs: int = 0) -> tuple[jax.Array, SlotState, jax.Array | None]:
    """One decoding step of every active slot: (next anchor [B], slots, with logprobs = k > 0 the new tokens'
    packed `TokenLogprobs` [B, 1 + 2k], else None). stochastic (static): False — every active slot greedy, a
    branch-free argmax program; True — the warped draw (`sampling.sample`). With `inputs.rows` (R < B rows) the
    step runs on those slots only (`gather_rows`; the others are inactive), at the cost of R rows — the same
    tokens, since a slot's randomness is its own (seed, step)."""
    rows = inputs.rows
    if rows is not None:
        sub, (a, samp, pen) = gather_rows(rows, slots, (anchor, inputs.sampling, inputs.penalty))
        tok, sub, lps = ar_step(graphdef, params, sub, a, inputs.over_rows(samp, pen), stochastic=stochastic,
                                logprobs=logprobs)
        full = None if lps is None else jnp.zeros((anchor.shape[0], lps.shape[1]), I32)
        slots, (anchor, lps) = put_rows(rows, slots, sub, (anchor, full), (tok, lps))
        return anchor, slots, lps
    model: TargetModel = nnx.merge(graphdef, params)
    active = inputs.active
    logits, _, state = model.extend(slots.target, anchor[:, None], active[:, None])
    last, hist = _step_penalty(logits[:, 0], anchor, inputs, slots.hist)
    tok = sample(last, inputs.sampling, inputs.steps, stochastic)
    lps = token_logprobs(logits, tok[:, None], logprobs).pack() if logprobs else None
    return jnp.where(active, tok, anchor), slots.replace(target=state, hist=hist), lps


def spec_step(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
              slots: SlotState, anchor: jax.Array, inputs: StepInputs, *, shape: RoundShape
              ) -> tuple[SlotState, jax.Array, RoundOutput]:
    """The width-1 round (`RoundShape.plain`, `runtime.width`): one plain decoding step of every active slot, as
    `ar_step`, that also appends the anchor's tap-layer features to the slot's drafter context (as `spec_prefill`
    does for a chunk), so a later speculative round drafts from an up-to-date context — plain decoding at the
    decoding step's cost. Returns what `spec_round` returns (nothing drafted: no accepted drafts, gains −1)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter | MTPHead = nnx.merge(dgraph, dparams)
    active, anchor_in, dstate = inputs.active, anchor, slots.drafter
    logits, taps, state = target.extend(slots.target, anchor[:, None], active[:, None], tap_layers=shape.tap_layers)
    n = active.astype(I32)
    if isinstance(dstate, MTPState):
        dstate = drafter.append(dstate, target.model.embed_tokens.weight[...], anchor[:, None],
                                target.model.norm(taps[0]), n)
    else:
        dstate = drafter.append_context(dstate, taps, n)
    last, hist = _step_penalty(logits[:, 0], anchor, inputs, slots.hist)
    tok = sample(last, inputs.sampling, inputs.steps, shape.stochastic)
    bonus = jnp.where(active, tok, anchor_in)
    B = anchor.shape[0]
    gains = jnp.full((B, len(shape.gain_widths)), -1.0, jnp.float32) if shape.gain_widths else None
    lps = token_logprobs(logits, bonus[:, None], shape.logprobs) if shape.logprobs else None
    out = RoundOutput(tokens=bonus[:, None], count=n, accepted=jnp.zeros((B,), I32), gains=gains, logprobs=lps)
    return SlotState(target=state, drafter=dstate, hist=hist), bonus, out


def spec_round_io(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                  slots: SlotState, anchor: jax.Array, inputs: StepInputs, *, shape: RoundShape
                  ) -> tuple[SlotState, jax.Array, jax.Array]:
    """The request loop's round program: `spec.round.spec_round` (width 1: `spec_step`) with its host outputs
    packed into one int32 array (`RoundOutput.pack`: one device→host transfer): (slots, anchor, packed output).
    With `inputs.rows` (R < B rows, `StepInputs.pack(rows=...)`) the round runs on those R slots alone
    (`gather_rows`; the packed output then has R rows, in that order; `spread_rows` on the host) — the same
    tokens as the round over all B slots, at the cost of R."""
    rows = inputs.rows
    if rows is not None:
        sub, (a, samp, pen) = gather_rows(rows, slots, (anchor, inputs.sampling, inputs.penalty))
        sub, bonus, packed = spec_round_io(tgraph, tparams, dgraph, dparams, sub, a, inputs.over_rows(samp, pen),
                                           shape=shape)                        # padding rows: active 0
        slots, (anchor,) = put_rows(rows, slots, sub, (anchor,), (bonus,))
        return slots, anchor, packed
    run = spec_step if shape.plain else spec_round
    slots, anchor, out = run(tgraph, tparams, dgraph, dparams, slots, anchor, inputs, shape=shape)
    return slots, anchor, out.pack()


def spread_rows(host_out: np.ndarray, rows: np.ndarray | None, slots: int) -> np.ndarray:
    """The packed output of a round over `rows` as the [slots, ...] one of the whole batch (the other slots, all
    inactive: zeros); unchanged without rows."""
    if rows is None:
        return host_out
    full = np.zeros((slots, host_out.shape[1]), host_out.dtype)
    real = rows < slots
    full[rows[real]] = host_out[real]
    return full


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


# Anchors are never donated: in plain decoding the anchor array a step returns is also what the host reads, and the loop
# dispatches the next step before reading it. The slot state is (`SlotState`).
ar_prefill_jit = DiskCachedJit(ar_prefill, name="ar_prefill", static_argnames=("graphdef", "logprobs"),
                               donate_argnames=("slots",))
spec_prefill_jit = DiskCachedJit(spec_prefill, name="spec_prefill",
                                 static_argnames=("tgraph", "dgraph", "shape"),
                                 donate_argnames=("slots",))
ar_step_jit = DiskCachedJit(ar_step, name="ar_step", static_argnames=("graphdef", "stochastic", "logprobs"),
                            donate_argnames=("slots",))
spec_round_io_jit = DiskCachedJit(spec_round_io, name="spec_round_io", static_argnames=("tgraph", "dgraph", "shape"),
                                  donate_argnames=("slots",))
