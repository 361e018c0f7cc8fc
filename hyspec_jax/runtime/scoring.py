"""The target's log-probabilities of given tokens (`hyspec_jax.logprobs`): one no-cache forward of the target
(`models.target.forward_full`) over a sequence.

The tokens a server generates carry theirs from the programs that emitted them (`runtime.programs`,
`spec.round`); the scorer serves what no program emitted: an `echo`ed prompt's, scored once per request.

One program per length bucket (`score_buckets`: powers of four from 16, then the context's power of two), compiled at
start-up: padding a rare request's sequence up to 4x costs less than compiling twice the programs (on a 2-core CPU
the powers of two up to a 2048-token context were 8 of a default server's 38 start-up programs).
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
from hyspec_jax.runtime.backend import MIN_CHUNK, bucket


def score_tokens(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, valid: jax.Array, *,
                 top_k: int) -> TokenLogprobs:
    """tokens, valid [R, T] -> the `TokenLogprobs` [R, T-1] of tokens[:, j] given tokens[:, :j], j = 1..T-1."""
    logits = forward_full(graphdef, params, tokens, valid)
    return token_logprobs(logits[:, :-1], tokens[:, 1:], top_k)


score_jit = DiskCachedJit(score_tokens, name="score_tokens", static_argnames=("graphdef", "top_k"))


def score_buckets(max_len: int) -> list[int]:
    """The padded lengths of sequences of 1..max_len tokens: powers of four from 16 below max_len's power of two
    (`runtime.backend.bucket`), then that one."""
    top, out, t = bucket(max_len), [], MIN_CHUNK
    while t < top:
        out.append(t)
        t *= 4
    return out + [top]


class Scorer:
    """Scores token sequences of up to `max_len` tokens with the target (graphdef, params as the backends take
    them); `top_k`: the most alternatives a request may ask for (static: one program per length bucket)."""

    def __init__(self, graphdef, params, max_len: int, top_k: int):
        self.graphdef, self.params, self.max_len, self.top_k = graphdef, params, max_len, top_k
        self.buckets = score_buckets(max_len)

    def compile(self, progress: Callable[[str], None] | None = None, workers: int | None = None) -> None:
        """Compile every bucket's program without running it (`compilation.precompile`: side by side on `workers`
        threads, default `compilation.compile_workers()`), so that scoring any length up to `max_len` compiles
        nothing; `progress(label)` per program, with its compile seconds. Not run at start-up: a run of the longest
        bucket's forward alone was 4 s of a warm 2-core server's 14 s start-up. A program that did not compile is
        run, to raise its error now."""
        from hyspec_jax.compilation import compile_workers, precompile
        workers = compile_workers() if workers is None else int(workers)
        failed = []

        def done(i: int, seconds: float | None) -> None:
            if seconds is None:
                failed.append(self.buckets[i])
            elif progress:
                progress(f"score [1x{self.buckets[i]}] {seconds:.1f}s")
        precompile([(score_jit, self._args(np.zeros(t, np.int32), t), {"top_k": self.top_k}) for t in self.buckets],
                   max(1, workers), done)
        for t in sorted(failed):
            self._run(np.zeros(t, np.int32), t)

    def _args(self, ids: np.ndarray, n: int) -> tuple:
        """score_jit's positional arguments for the first n of ids: (graphdef, params, tokens, valid), padded to
        the smallest of `buckets` that holds them."""
        T = next(t for t in self.buckets if t >= n)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = ids[:n]
        valid = np.zeros((1, T), bool)
        valid[0, :n] = True
        return self.graphdef, self.params, jnp.asarray(tokens), jnp.asarray(valid)

    def _run(self, ids: np.ndarray, n: int):
        return jax.device_get(score_jit(*self._args(ids, n), top_k=self.top_k))

    def score(self, ids: list[int], start: int = 1) -> TokenScores:
        """Scores of ids[start:] (start >= 1) given the tokens before each."""
        n = len(ids)
        if not 1 <= start <= n or n > self.max_len:
            raise ValueError(f"cannot score positions {start}..{n - 1} of {n} tokens (at most {self.max_len})")
        if start == n:
            return NO_SCORES
        return self._run(np.asarray(ids, np.int32), n).scores(0, n - 1)[start - 1:]


def compile_server(backend, scorer: Scorer | None, progress: Callable[[str], None] | None = None,
                   workers: int | None = None) -> None:
    """A server's start-up compile: its backend's programs (`Backend.compile`) and its scorer's, if any. With several
    compile workers (default `compilation.compile_workers()`), the scorer's buckets compile one after another on a
    thread of their own beside the backend's pass — whose first program compiles alone, leaving the other cores
    idle — so that no core waits for the other pass. Else the scorer after the backend, as also where the backend
    times rounds at start-up (`calibrate_repeats`: the scorer would disturb the timings) or runs over a mesh (its
    pass repeats while anything compiles, and across processes every process must run the same programs in the
    same order)."""
    from concurrent.futures import ThreadPoolExecutor

    from hyspec_jax.compilation import compile_workers
    from hyspec_jax.sharding import params_mesh
    workers = compile_workers() if workers is None else int(workers)
    if (scorer is None or workers < 2 or getattr(backend, "calibrate_repeats", 0)
            or params_mesh(backend.params) is not None):
        backend.compile(progress, workers=workers)
        if scorer is not None:
            scorer.compile(progress, workers=workers)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyspec-score") as pool:
        scoring = pool.submit(scorer.compile, progress, 1)
        backend.compile(progress, workers=workers)
        scoring.result()
