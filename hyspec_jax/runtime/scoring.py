"""The target's log-probabilities of given tokens (`hyspec_jax.logprobs`): one no-cache forward of the target
(`models.target.forward_full`) over a sequence.

The tokens a server generates carry theirs from the programs that emitted them (`runtime.programs`,
`spec.round`); the scorer serves what no program emitted: an `echo`ed prompt's, scored once per request.

One program per length bucket (powers of two ≥ 16, `runtime.backend.prompt_buckets`), compiled at start-up.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.compilation import DiskCachedJit
from hyspec_jax.logprobs import NO_SCORES, TokenLogprobs, TokenScores, token_logprobs
from hyspec_jax.models.target import forward_full
from hyspec_jax.runtime.backend import bucket, prompt_buckets


def score_tokens(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, valid: jax.Array, *,
                 top_k: int) -> TokenLogprobs:
    """tokens, valid [R, T] -> the `TokenLogprobs` [R, T-1] of tokens[:, j] given tokens[:, :j], j = 1..T-1."""
    logits = forward_full(graphdef, params, tokens, valid)
    return token_logprobs(logits[:, :-1], tokens[:, 1:], top_k)


score_jit = DiskCachedJit(score_tokens, name="score_tokens", static_argnames=("graphdef", "top_k"))


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
            return NO_SCORES
        return self._run(np.asarray(ids, np.int32), n).scores(0, n - 1)[start - 1:]
