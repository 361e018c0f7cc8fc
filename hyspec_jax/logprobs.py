"""The target's log-probabilities of tokens, as the OpenAI `logprobs` fields report them: for each token,
log p_target(token | the tokens before it) and the top-k most likely alternatives there.

The raw distribution (log_softmax of the target's logits: no penalties, temperature, top-p or top-k), as vLLM's
default `raw_logprobs` mode reports, whatever mode decoded the tokens. `token_logprobs` is the one formula: the
programs that emit tokens apply it to the logits they already hold (prefill at its last position, a decoding step,
a round at the accepted path's nodes: `runtime.programs`, `spec.round`), and the scorer of given sequences
(`runtime.scoring`, the server's `echo`) to a no-cache forward.

On the device a `TokenLogprobs` rides with the tokens it scores, packed into the program's one int32 output
(`pack`, floats bit-cast); the host unpacks it (numpy) and hands each request its rows as `TokenScores`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

I32 = jnp.int32
F32 = jnp.float32


@struct.dataclass
class TokenLogprobs:
    """Per row and position: log p of the token there, its top_k alternatives (most likely first) and theirs. jax
    arrays in a program, numpy after `unpack`."""
    logprob: jax.Array          # [R, K] float32
    top_ids: jax.Array          # [R, K, k] int32
    top_logprobs: jax.Array     # [R, K, k] float32

    @staticmethod
    def columns(positions: int, top_k: int) -> int:
        """Width of `pack`'s array for `positions` positions of `top_k` alternatives."""
        return positions * (1 + 2 * top_k)

    def pack(self) -> jax.Array:
        """[R, K · (1 + 2k)] int32: the K logprobs, the K · k ids, the K · k top logprobs (float32 bits)."""
        R = self.logprob.shape[0]
        bits = lambda x: jax.lax.bitcast_convert_type(x.astype(F32), I32).reshape(R, -1)  # noqa: E731
        return jnp.concatenate([bits(self.logprob), self.top_ids.astype(I32).reshape(R, -1),
                                bits(self.top_logprobs)], axis=1)

    @classmethod
    def unpack(cls, host: np.ndarray, top_k: int) -> "TokenLogprobs":
        """`pack`'s array (host) back into named numpy fields."""
        host = np.asarray(host)
        R, K = host.shape[0], host.shape[1] // (1 + 2 * top_k)
        floats = lambda x: np.ascontiguousarray(x).view(np.float32)  # noqa: E731
        return cls(logprob=floats(host[:, :K]), top_ids=host[:, K:K + K * top_k].reshape(R, K, top_k),
                   top_logprobs=floats(host[:, K + K * top_k:]).reshape(R, K, top_k))

    def scores(self, row: int, n: int) -> "TokenScores":
        """Host: row `row`'s first n positions as plain lists."""
        return TokenScores(self.logprob[row, :n].tolist(), self.top_ids[row, :n].tolist(),
                           self.top_logprobs[row, :n].tolist())


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_k: int) -> TokenLogprobs:
    """logits [..., V] of the distribution each of tokens [...] was chosen from -> its `TokenLogprobs` (top_k
    static, ≥ 0)."""
    lp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(I32), axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, max(top_k, 1))
    return TokenLogprobs(logprob=chosen, top_ids=top_ids[..., :top_k].astype(I32), top_logprobs=top_lp[..., :top_k])


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """One sequence's scores as plain lists (what a request is handed and the server renders)."""
    logprobs: list[float]                    # log p of each token
    top_ids: list[list[int]]                 # the top_k alternatives at each position, most likely first
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprobs)

    def __add__(self, other: "TokenScores") -> "TokenScores":
        """These positions, then other's."""
        return TokenScores(self.logprobs + other.logprobs, self.top_ids + other.top_ids,
                           self.top_logprobs + other.top_logprobs)

    def __getitem__(self, s: slice) -> "TokenScores":
        return TokenScores(self.logprobs[s], self.top_ids[s], self.top_logprobs[s])


NO_SCORES = TokenScores([], [], [])
