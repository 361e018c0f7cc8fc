"""Sampling: penalties (vLLM's), then temperature → top-k → top-p warping (Hugging Face order), per-slot
parameters on device.

`penalize` then `warp` is the single definition of the distribution a request samples from; speculative acceptance
applies the same to the target's logits (penalties with each tree node's own history, `penalize_tree`) so that
rejection sampling stays lossless.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 = greedy; top_k 0 / top_p 1 = disabled."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's penalties (`penalize`); the neutral values switch them off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 1e4:     # also rejects nan
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def penalized(self) -> bool:
        return penalized(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSampling:
    """SamplingParams of every slot as device arrays (changing them never recompiles)."""

    temperature: jax.Array  # [B] f32
    top_p: jax.Array        # [B] f32
    top_k: jax.Array        # [B] int32
    seed: jax.Array         # [B] uint32

    @classmethod
    def from_params(cls, params: list[SamplingParams], batch: int) -> "SlotSampling":
        pad = params + [SamplingParams()] * (batch - len(params))
        return _slot_sampling(tuple((float(p.temperature), float(p.top_p), int(p.top_k), int(p.seed) % (1 << 32))
                                    for p in pad))

    @classmethod
    def of(cls, temperature, top_p, top_k, seed) -> "SlotSampling":
        """From per-row host values (sequences of equal length)."""
        return _slot_sampling(tuple((float(t), float(p), int(k), int(s) % (1 << 32))
                                    for t, p, k, s in zip(temperature, top_p, top_k, seed)))


@functools.lru_cache(maxsize=256)
def _slot_sampling(slots: tuple[tuple[float, float, int, int], ...]) -> SlotSampling:
    """The device arrays of these per-slot (temperature, top_p, top_k, seed), made once: each generation and
    admission asks again, and a transfer costs ~0.1 ms of host time beside a GPU (device arrays are immutable,
    so sharing them is safe)."""
    t, p, k, s = zip(*slots)
    host = (np.asarray(t, np.float32), np.asarray(p, np.float32), np.asarray(k, np.int32), np.asarray(s, np.uint32))
    return SlotSampling(*jax.device_put(host))


def penalized(presence: float, frequency: float, repetition: float) -> bool:
    """Whether these penalties change anything (the penalized program flavours run only then)."""
    return presence != 0.0 or frequency != 0.0 or repetition != 1.0


@jax.named_scope("penalties")
def penalize(logits: jax.Array, counts: jax.Array, seen: jax.Array, presence: jax.Array, frequency: jax.Array,
             repetition: jax.Array) -> jax.Array:
    """vLLM's penalties (`apply_penalties`): fp32 logits [..., V].

    counts [..., V]: occurrences of each token in the output so far; seen [..., V] bool: in the prompt or the
    output. Parameters broadcast against logits[..., 0]. repetition r on every seen token (logit > 0: / r, else
    · r), then frequency f and presence p over the output: logit −= f · count + p · (count > 0). Neutral
    parameters (0, 0, 1) leave the logits bitwise unchanged."""
    x = logits.astype(F32)
    r = repetition[..., None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    c = counts.astype(F32)
    return x - frequency[..., None] * c - presence[..., None] * (c > 0).astype(F32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyCounts:
    """Per-slot penalty history on the device (a backend's state beside the slots' committed state, donated by the
    penalized programs): output counts and the seen set. A slot's anchor — emitted, not processed yet — is not
    counted until the step that processes it (`add` of the anchor), so prefill never counts outputs."""

    counts: jax.Array   # [B, V] int32
    seen: jax.Array     # [B, V] bool

    def add(self, tokens: jax.Array, mask: jax.Array, output: bool = True) -> "PenaltyCounts":
        """Count tokens [B, K] where mask [B, K] (output=False: mark them seen only, a prompt's)."""
        B, V = self.counts.shape
        tok = jnp.where(mask, tokens, V)                  # index V: dropped
        rows = jnp.arange(B)[:, None]
        counts = self.counts.at[rows, tok].add(1, mode="drop") if output else self.counts
        return PenaltyCounts(counts=counts, seen=self.seen.at[rows, tok].set(True, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotPenalty:
    """Per-slot penalty parameters as device arrays (like `SlotSampling`)."""

    presence: jax.Array     # [B] f32
    frequency: jax.Array    # [B] f32
    repetition: jax.Array   # [B] f32

    @classmethod
    def of(cls, presence, frequency, repetition) -> "SlotPenalty":
        return _slot_penalty(tuple((float(p), float(f), float(r)) for p, f, r in zip(presence, frequency, repetition)))

    def apply(self, logits: jax.Array, hist: PenaltyCounts) -> jax.Array:
        """`penalize` logits [B, V] with each slot's history."""
        return penalize(logits, hist.counts, hist.seen, self.presence, self.frequency, self.repetition)


@functools.lru_cache(maxsize=256)
def _slot_penalty(slots: tuple[tuple[float, float, float], ...]) -> SlotPenalty:
    return SlotPenalty(*jax.device_put(tuple(np.asarray(c, np.float32) for c in zip(*slots))))


@jax.named_scope("penalties")
def penalize_tree(logits: jax.Array, tokens: jax.Array, tree, hist: PenaltyCounts, penalty: SlotPenalty) -> jax.Array:
    """`penalize` the target's logits [B, N, V] at every node of a verified forest (`hyspec_jax.tree.Tree`; node 0
    = the anchor, counted in `hist`): node v's history is the slot's plus the draft tokens on v's path from the
    anchor's child down to v inclusive (the output if v is accepted) — its first depth(v) ancestors, v itself
    first (`tree.kth_ancestor`). The base penalty broadcast over the nodes, then those ≤ max_depth path tokens of
    each node recomputed with their total counts. tokens [B, N]."""
    from hyspec_jax import tree as tree_lib

    B, N, V = logits.shape
    prm = lambda x: x[:, None]  # noqa: E731 - [B] -> [B, 1], against [B, N]
    out = penalize(logits, hist.counts[:, None], hist.seen[:, None], prm(penalty.presence), prm(penalty.frequency),
                   prm(penalty.repetition))
    D = tree.max_depth
    if D == 0:
        return out
    anc = tree_lib.kth_ancestor(tree, D - 1)                                    # [B, N, D]: v, its parent, ...
    ok = jnp.arange(D, dtype=jnp.int32) < tree.depth[..., None]                # the drafts on v's path
    at = jnp.take_along_axis(tokens, jnp.maximum(anc, 0).reshape(B, -1), axis=1).reshape(B, N, D)
    path = jnp.where(ok, at, 0)
    in_path = jnp.sum((path[..., :, None] == path[..., None, :]) & ok[..., None, :], axis=-1)
    base = jnp.take_along_axis(hist.counts, path.reshape(B, -1), axis=1).reshape(path.shape)
    raw = jnp.take_along_axis(logits, path, axis=2)
    fixed = penalize(raw, base + in_path, jnp.ones_like(ok), prm(penalty.presence), prm(penalty.frequency),
                     prm(penalty.repetition))
    b = jnp.arange(B)[:, None, None]
    n = jnp.arange(N)[None, :, None]
    return out.at[b, n, jnp.where(ok, path, V)].set(fixed, mode="drop")


@jax.named_scope("sampling")
def warp(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Log-probabilities [..., V] after temperature, top-k and top-p (−inf outside the kept set).

    logits [..., V]; parameters broadcast against logits[..., 0]. Greedy slots (temperature 0) get a
    one-hot distribution on the argmax, so acceptance rules need no special case.
    """
    logits = logits.astype(F32)
    V = logits.shape[-1]
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[..., None]
    scaled = logits / t
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth = jnp.take_along_axis(desc, (k - 1)[..., None].astype(jnp.int32), axis=-1)
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    desc = jnp.where(jnp.arange(V) < k[..., None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs              # mass strictly above each sorted token
    keep_sorted = (before < top_p[..., None]) | (top_p[..., None] >= 1.0)   # always keeps the top token
    cutoff = jnp.min(jnp.where(keep_sorted, desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    onehot = jnp.where(jnp.arange(V) == jnp.argmax(logits, axis=-1)[..., None], 0.0, -jnp.inf)
    return jnp.where(greedy[..., None], onehot, logp)


def slot_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per slot from (its seed, its decode step): fold_in(key(seed_b), step_b), step a scalar or [B].
    A request's samples do not depend on which other requests share the batch."""
    steps = jnp.broadcast_to(jnp.asarray(step), seed.shape)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, steps)


@jax.named_scope("sampling")
def greedy_tokens(logits: jax.Array) -> jax.Array:
    """logits [B, V] -> the argmax tokens [B] int32: what the warped one-hot distribution of a greedy slot draws."""
    return jnp.argmax(logits.astype(F32), axis=-1).astype(jnp.int32)


@jax.named_scope("sampling")
def sample(logits: jax.Array, sampling: SlotSampling, step: jax.Array, stochastic: bool | None = None) -> jax.Array:
    """logits [B, V] -> tokens [B] int32; step: the decode step, a scalar or one per slot [B] (`slot_keys`).

    stochastic (static): False — every slot is greedy, the argmax alone (what the warped one-hot distribution
    draws), skipping the sort, softmax and Gumbel noise over the vocabulary (~2 ms per decode step on a CPU, a
    fifth of the embedded model's step); True — the warped draw for every slot (greedy slots still get their
    argmax). None — decided at run time by a `lax.cond` on the temperatures: one program for both (XLA:GPU reads
    a conditional's predicate back to the host; on the H200 that cost nothing measurable a decode step,
    `bench/results/profile/decode_branch_cost_h200.json`); callers that know the batch's sampling parameters pass the flag
    and get one branch-free program each."""
    def draw(_):
        logp = warp(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        keys = slot_keys(sampling.seed, step)
        return jax.vmap(lambda key, lp: jax.random.categorical(key, lp))(keys, logp).astype(jnp.int32)

    if stochastic is None:
        return jax.lax.cond(jnp.all(sampling.temperature <= 0), lambda _: greedy_tokens(logits), draw, None)
    return draw(None) if stochastic else greedy_tokens(logits)
