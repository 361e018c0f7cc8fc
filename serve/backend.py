"""Device side of the server: the batched slot state and the jitted programs the scheduler calls.

Every slot holds one request's committed state (`TargetState` row; with a drafter also its `DrafterState` row).
Two kinds of call, each compiled once per static shape at start-up and then reused:

- `prefill(rows)` — up to P rows of prompt chunks [P, T] (P·T = the prefill token budget, T a power of two):
  the slots' rows are gathered from the batched state (reset for a request's first chunk), extended by the
  target, scattered back; the last chunk of a prompt samples the request's first token (PRNG step 0, as
  `hyspec_jax.generate.Generator` does). Short prompts are packed several to a call; long prompts are cut into
  chunks so that decoding continues between their chunks.
- `step(active)` — one decoding step for every slot: AR (one token per active slot) or one speculative round
  (`hyspec_jax.spec.engine.spec_round_io_jit`: draft → verify → accept → commit, ≥ 1 token per active slot).

Sampling parameters are per-slot device arrays (`SlotSampling`) and the PRNG key of a slot is
fold_in(key(seed), step) with its own step counter, so neither the parameters nor the batch composition
ever trigger a recompile or change a request's samples.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.compilation import split_for_jit
from hyspec_jax.generate import bucket
from hyspec_jax.models.target import TargetModel
from hyspec_jax.sampling import SlotSampling, greedy_tokens, warp
from hyspec_jax.state import TargetState, init_state

log = logging.getLogger("hyspec.serve")
I32 = jnp.int32
F32 = jnp.float32
MIN_CHUNK = 16


def sample_rows(logits: jax.Array, sampling: SlotSampling, steps: jax.Array) -> jax.Array:
    """logits [B, V] -> tokens [B]; row b uses key fold_in(key(seed_b), steps_b)."""
    logp = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(sampling.seed, steps)
    return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp).astype(I32)


def _rows(x: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, idx, axis=axis)


def _reset(x: jax.Array, reset: jax.Array, axis: int) -> jax.Array:
    shape = [1] * x.ndim
    shape[axis] = reset.shape[0]
    return jnp.where(reset.reshape(shape), jnp.zeros_like(x), x)


def _gather_target(state: TargetState, slots: jax.Array, reset: jax.Array) -> TargetState:
    idx = jnp.minimum(slots, state.batch - 1)
    return TargetState(ssm=_reset(_rows(state.ssm, idx, 1), reset, 1),
                       conv=_reset(_rows(state.conv, idx, 1), reset, 1),
                       keys=_rows(state.keys, idx, 1), values=_rows(state.values, idx, 1),
                       lengths=jnp.where(reset, 0, _rows(state.lengths, idx, 0)))


def _scatter_target(state: TargetState, slots: jax.Array, sub: TargetState) -> TargetState:
    """Write rows back; padding rows carry slot index B and are dropped."""
    put = lambda full, part: full.at[:, slots].set(part.astype(full.dtype), mode="drop")  # noqa: E731
    return TargetState(ssm=put(state.ssm, sub.ssm), conv=put(state.conv, sub.conv), keys=put(state.keys, sub.keys),
                       values=put(state.values, sub.values),
                       lengths=state.lengths.at[slots].set(sub.lengths, mode="drop"))


def _ar_prefill(graphdef, params, state, slots, tokens, valid, reset, sampling):
    model: TargetModel = nnx.merge(graphdef, params)
    sub = _gather_target(state, slots, reset)
    logits, _, sub = model.extend(sub, tokens, valid, last_only=True)
    first = sample_rows(logits[:, 0], sampling, jnp.zeros(slots.shape, I32))
    return first, _scatter_target(state, slots, sub)


def _ar_decode(graphdef, params, state, tokens, active, sampling, steps, stochastic: bool):
    model: TargetModel = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, tokens[:, None], active[:, None])
    if not stochastic:          # every active slot greedy
        return greedy_tokens(logits[:, 0]), state
    return sample_rows(logits[:, 0], sampling, steps), state


_ar_prefill_jit = jax.jit(_ar_prefill, static_argnames=("graphdef",), donate_argnames=("state",))
# stochastic (static): a greedy and a sampling program (the scheduler knows which its active slots need), no
# run-time branch: greedy steps skip the vocabulary-wide warp (twice the CPU's greedy throughput)
_ar_decode_jit = jax.jit(_ar_decode, static_argnames=("graphdef", "stochastic"), donate_argnames=("state",))


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray          # [B, K] committed tokens per slot (first count[b] valid)
    count: np.ndarray           # [B]
    accepted: np.ndarray | None = None   # [B] accepted drafts per slot (speculative modes)
    drafted: int = 0            # draft tokens verified per active slot this round


def prefill_shapes(chunk: int, max_rows: int) -> list[tuple[int, int]]:
    """The static (rows, T) prefill shapes for a prefill token budget `chunk` (a power of two ≥ 16)."""
    out, t = [], MIN_CHUNK
    while t <= chunk:
        out.append((max(1, min(max_rows, chunk // t)), t))
        t *= 2
    return out


class Backend(abc.ABC):
    """Common host interface of the AR and speculative backends."""

    mode = "ar"
    depth = 0                    # max drafts per round (0 for AR)

    def __init__(self, target: TargetModel, *, slots: int, max_len: int, prefill_chunk: int):
        if prefill_chunk < MIN_CHUNK or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill chunk must be a power of two >= {MIN_CHUNK}, got {prefill_chunk}")
        self.config = target.config
        self.graphdef, self.params = split_for_jit(target)     # cheap to pass every step (compilation.py)
        leaves = jax.tree.leaves(self.params)
        self.dtype = leaves[0].dtype if leaves else F32
        self.slots, self.max_len, self.prefill_chunk = slots, max_len, prefill_chunk
        self.shapes = prefill_shapes(prefill_chunk, slots)
        self.state = init_state(self.config, slots, self.kv_len, self.dtype)

    @property
    def kv_len(self) -> int:
        """Positions allocated per slot (the context length plus room a round may overshoot)."""
        return self.max_len + (self.depth + 2 if self.depth else 0)

    def shape_for(self, rows_needed: list[int]) -> tuple[int, int]:
        """Best static shape for chunks of these remaining prompt lengths (FIFO order): most tokens."""
        best, best_tokens = self.shapes[0], -1
        for rows, t in self.shapes:
            n = sum(min(r, t) for r in rows_needed[:rows])
            if n > best_tokens:
                best, best_tokens = (rows, t), n
        return best

    def sampling(self, temperature, top_p, top_k, seed) -> SlotSampling:
        return SlotSampling(temperature=jnp.asarray(temperature, F32), top_p=jnp.asarray(top_p, F32),
                            top_k=jnp.asarray(top_k, I32), seed=jnp.asarray(seed, jnp.uint32))

    def warm_up(self, progress: Callable[[str], None] = lambda s: None) -> None:
        """Compile every program the server will call (all prefill shapes, the decode step) with no-op inputs."""
        B = self.slots
        zeros = lambda n, dt: np.zeros(n, dt)  # noqa: E731
        for rows, t in self.shapes:
            t0 = time.perf_counter()
            samp = self.sampling(zeros(rows, np.float32), np.ones(rows, np.float32), zeros(rows, np.int32),
                                 zeros(rows, np.uint32))
            self.prefill(np.full(rows, B, np.int32), np.zeros((rows, t), np.int32), np.zeros((rows, t), bool),
                         np.zeros(rows, bool), samp)
            progress(f"prefill [{rows}x{t}] {time.perf_counter() - t0:.1f}s")
        self._warm_steps(progress)

    # --- to implement ------------------------------------------------------------------------------
    @abc.abstractmethod
    def prefill(self, slots, tokens, valid, reset, sampling) -> np.ndarray:
        """Run prompt chunks [P, T] into slots `slots` [P] (B = padding row); returns the sampled first tokens."""

    @abc.abstractmethod
    def step(self, active: np.ndarray, last: np.ndarray, sampling: SlotSampling, steps: np.ndarray,
             stochastic: bool) -> StepResult:
        """One decoding step (AR) or speculative round for every active slot."""

    @abc.abstractmethod
    def _warm_steps(self, progress) -> None:
        """Compile the step programs (called by `warm_up` after the prefill shapes)."""


class ARBackend(Backend):
    mode = "ar"

    def prefill(self, slots, tokens, valid, reset, sampling) -> np.ndarray:
        # host arrays go straight to the jitted call (a jnp.asarray is one more dispatch each); copies, since
        # the scheduler reuses its buffers
        first, self.state = _ar_prefill_jit(self.graphdef, self.params, self.state, np.array(slots, np.int32),
                                            np.array(tokens, np.int32), np.array(valid, bool),
                                            np.array(reset, bool), sampling)
        return np.asarray(first)

    def step(self, active, last, sampling, steps, stochastic) -> StepResult:
        nxt, self.state = _ar_decode_jit(self.graphdef, self.params, self.state, np.array(last, np.int32),
                                         np.array(active, bool), sampling, np.array(steps, np.int32),
                                         stochastic=bool(stochastic))
        nxt = np.asarray(nxt)
        return StepResult(tokens=nxt[:, None], count=active.astype(np.int32))

    def _warm_steps(self, progress) -> None:
        B = self.slots
        t0 = time.perf_counter()
        samp = self.sampling(np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.int32),
                             np.zeros(B, np.uint32))
        for stochastic in (False, True):
            self.step(np.zeros(B, bool), np.zeros(B, np.int32), samp, np.zeros(B, np.int32), stochastic)
        progress(f"decode [{B}, greedy + sampling] {time.perf_counter() - t0:.1f}s")


def bucket_len(n: int) -> int:
    return bucket(n, MIN_CHUNK)
