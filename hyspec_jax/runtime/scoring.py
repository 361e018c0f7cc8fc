"""The target's log-probabilities of given tokens: one no-cache forward over prompt + completion.

The OpenAI `logprobs` / `echo` fields report, for each token, log p_target(token | the tokens before it) and the
most likely alternatives there. Under speculative decoding the round never forms the target's full distribution
at every emitted position in one place (a drafted token is accepted against it, a rejected one resampled from a
residual), so the server does not read them from the round: it scores the finished token sequence with one plain
forward of the target (`models.target.forward_full`), which is exact whatever mode produced the tokens and leaves
the round untouched. The raw distribution is scored (no temperature / top-p / top-k), as vLLM's default
`raw_logprobs` mode does.

One program per length bucket (powers of two ≥ 16, `runtime.backend.prompt_buckets`), compiled at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.models.target import forward_full
from hyspec_jax.runtime.backend import bucket, prompt_buckets


def score_tokens(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, valid: jax.Array, *,
                 top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens, valid [R, T] -> (log p of tokens[:, j] given tokens[:, :j] for j = 1..T-1 [R, T-1], the top_k
    most likely tokens at each of those positions [R, T-1, K] and their log-probabilities [R, T-1, K])."""
    logits = forward_full(graphdef, params, tokens, valid)
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, max(top_k, 1))
    return chosen, top_ids[..., :top_k], top_lp[..., :top_k]


score_jit = DiskCachedJit(score_tokens, name="score_tokens", static_argnames=("graphdef", "top_k"))


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Scores of positions start..n-1 of a sequence of n tokens (position 0 has no context: never scored)."""
    logprobs: list[float]                    # log p of each token
    top_ids: list[list[int]]                 # the top_k alternatives at each position, most likely first
    top_logprobs: list[list[float]]


class Scorer:
    """Scores token sequences of up to `max_len` tokens with the target (graphdef, params as the backends take
    them); `top_k`: the most alternatives a request may ask for (static: one program per length bucket)."""

    def __init__(self, graphdef, params, max_len: int, top_k: int):
        self.graphdef, self.params, self.max_len, self.top_k = graphdef, params, max_len, top_k
        self.buckets = prompt_buckets(max_len)

    def compile(self, progress: Callable[[str], None] | None = None) -> None:
        for t in self.buckets:
            self._run(np.zeros(t, np.int32), t)     # t tokens: the bucket-t program (1 token ran bucket 16 only)
            if progress:
                progress(f"score [1x{t}]")

    def _run(self, ids: np.ndarray, n: int):
        T = bucket(n)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = ids[:n]
        valid = np.zeros((1, T), bool)
        valid[0, :n] = True
        out = score_jit(self.graphdef, self.params, jnp.asarray(tokens), jnp.asarray(valid), top_k=self.top_k)
        return jax.device_get(out)

    def score(self, ids: list[int], start: int = 1) -> TokenScores:
        """Scores of ids[start:] (start >= 1) given the tokens before each."""
        n = len(ids)
        if not 1 <= start <= n or n > self.max_len:
            raise ValueError(f"cannot score positions {start}..{n - 1} of {n} tokens (at most {self.max_len})")
        if start == n:
            return TokenScores([], [], [])
        chosen, top_ids, top_lp = self._run(np.asarray(ids, np.int32), n)
        sl = slice(start - 1, n - 1)
        return TokenScores(chosen[0, sl].tolist(), top_ids[0, sl].tolist(), top_lp[0, sl].tolist())
