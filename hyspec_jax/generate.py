"""Plain autoregressive generation (the `ar` baseline and the losslessness oracle for speculation).

Static shapes: batch slots, prompt length and KV length are rounded up to buckets, so a generation never
recompiles after its first step; the state buffer is donated to every step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.config import TargetConfig
from hyspec_jax.sampling import SamplingParams, SlotSampling, sample
from hyspec_jax.state import TargetState, init_state


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two ≥ max(n, minimum)."""
    m = max(n, minimum, 1)
    return 1 << (m - 1).bit_length()


@dataclasses.dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str          # "stop" | "length"
    seconds: float = 0.0        # wall time of the whole batch (prefill + decode, compiles included)
    prefill_seconds: float = 0.0
    decode_steps_per_second: float = 0.0  # batch decode steps/s after the first (compiling) step


def _prefill(graphdef, params, state, tokens, valid, sampling):
    model = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, tokens, valid, last_only=True)
    return sample(logits[:, 0], sampling, jnp.zeros((), jnp.int32)), state


def _decode(graphdef, params, state, tokens, active, sampling, step):
    model = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, tokens[:, None], active[:, None])
    return sample(logits[:, 0], sampling, step), state


_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef",), donate_argnames=("state",))
_decode_jit = jax.jit(_decode, static_argnames=("graphdef",), donate_argnames=("state",))


class Generator:
    """Batched autoregressive generation with a target model split into (graphdef, params)."""

    def __init__(self, config: TargetConfig, graphdef: nnx.GraphDef, params: nnx.State):
        self.config, self.graphdef, self.params = config, graphdef, params
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype if leaves else jnp.float32

    @classmethod
    def from_model(cls, model) -> "Generator":
        graphdef, params = nnx.split(model)
        return cls(model.config, graphdef, params)

    def new_state(self, batch: int, max_len: int) -> TargetState:
        return init_state(self.config, batch, max_len, self.dtype)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for a batch of ragged prompts. `on_tokens(request_index, new_ids)` streams tokens."""
        if not prompts:
            return []
        n = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
        if len(plist) != n:
            raise ValueError(f"{n} prompts but {len(plist)} sampling params")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        B = bucket(n, 1)
        T = bucket(max(len(p) for p in prompts))
        max_new = max(p.max_tokens for p in plist)
        S = bucket(T + max_new, 128)
        tokens = np.zeros((B, T), np.int32)
        valid = np.zeros((B, T), bool)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
            valid[i, :len(p)] = True
        sampling = SlotSampling.from_params(plist, B)
        stops = [set(p.stop_token_ids) for p in plist]
        out: list[list[int]] = [[] for _ in range(n)]
        finish = [""] * n
        t0 = time.perf_counter()
        nxt, state = _prefill_jit(self.graphdef, self.params, self.new_state(B, S), jnp.asarray(tokens),
                                  jnp.asarray(valid), sampling)
        nxt_host = np.asarray(nxt)
        t_prefill = time.perf_counter() - t0
        active = np.zeros(B, bool)
        active[:n] = True
        step = 0
        t_warm = None
        while True:
            for i in range(n):
                if not active[i]:
                    continue
                tok = int(nxt_host[i])
                out[i].append(tok)
                if on_tokens is not None:
                    on_tokens(i, [tok])
                if tok in stops[i]:
                    finish[i], active[i] = "stop", False
                elif len(out[i]) >= plist[i].max_tokens:
                    finish[i], active[i] = "length", False
            if not active.any():
                break
            step += 1
            nxt, state = _decode_jit(self.graphdef, self.params, state, nxt, jnp.asarray(active), sampling,
                                     jnp.asarray(step, jnp.int32))
            nxt_host = np.asarray(nxt)
            if step == 1:
                t_warm = time.perf_counter()
        t_end = time.perf_counter()
        rate = (step - 1) / (t_end - t_warm) if t_warm is not None and step > 1 else 0.0
        return [GenerationResult(list(map(int, prompts[i])), out[i], finish[i], t_end - t0, t_prefill, rate)
                for i in range(n)]
