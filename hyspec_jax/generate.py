"""Plain autoregressive generation (the `ar` baseline and the losslessness oracle for speculation).

Static shapes: batch slots, prompt length and KV length are rounded up to buckets, so a generation never
recompiles after its first step; the state buffer is donated to every step. `Generator.compile_buckets` /
`warmup` compile buckets ahead of time (start-up); `compilations_after_startup` counts what compiled since.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.compilation import (CompileWatch, DiskCachedJit, enable_compilation_cache, pure_params,
                                    static_graphdef)
from hyspec_jax.config import TargetConfig
from hyspec_jax.sampling import SamplingParams, SlotSampling, sample
from hyspec_jax.state import TargetState, init_state


MIN_PROMPT_BUCKET = 16


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Next power of two ≥ max(n, minimum)."""
    m = max(n, minimum, 1)
    return 1 << (m - 1).bit_length()


def prompt_buckets(longest: int) -> list[int]:
    """The prefill lengths (powers of two ≥ 16) of prompts of 1..longest tokens."""
    out, t = [], MIN_PROMPT_BUCKET
    while longest > 0 and t <= bucket(longest):
        out.append(t)
        t *= 2
    return out


def compile_progress(total: int, enabled: bool):
    """The start-up compile progress bar (stderr)."""
    from tqdm import tqdm
    return tqdm(total=total, desc="compiling", unit="program", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def start_host_copy(x: jax.Array) -> None:
    """Start `x`'s device→host copy now (GPU), so that reading it later does not also wait behind work
    dispatched meanwhile. Not on a CPU: the result already lives in host memory, and the asynchronous copy of a
    buffer still being computed adds a PJRT code path that buys nothing there."""
    if _default_backend() != "cpu":
        x.copy_to_host_async()


@functools.cache
def _default_backend() -> str:
    return jax.default_backend()


def use_compilation_cache() -> None:
    """Start-up compiles go through JAX's persistent cache: the configured directory, else hyspec's default."""
    enable_compilation_cache(jax.config.jax_compilation_cache_dir)


def validate_prompts(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                     vocab_size: int) -> list[SamplingParams]:
    """Check a batch request (non-empty prompts of in-vocabulary ids, one SamplingParams or one per prompt) and
    return the per-prompt parameter list. Raises ValueError with the user-facing message."""
    n = len(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise ValueError(f"{n} prompts but {len(plist)} sampling params")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return plist


@dataclasses.dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str          # "stop" | "length"
    seconds: float = 0.0        # wall time of the whole batch (prefill + decode, compiles included)
    prefill_seconds: float = 0.0
    decode_steps_per_second: float = 0.0  # batch decode steps/s after the first (compiling) step


def _prefill(graphdef, params, state, tokens, valid, sampling, stochastic: bool):
    model = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, tokens, valid, last_only=True)
    return sample(logits[:, 0], sampling, jnp.zeros((), jnp.int32), stochastic), state


def _decode(graphdef, params, state, tokens, active, sampling, step, stochastic: bool):
    model = nnx.merge(graphdef, params)
    logits, _, state = model.extend(state, tokens[:, None], active[:, None])
    return sample(logits[:, 0], sampling, step, stochastic), state


# stochastic (static): one program for all-greedy batches and one for sampling ones (`sampling.sample`)
_prefill_jit = DiskCachedJit(_prefill, name="generate_prefill", static_argnames=("graphdef", "stochastic"),
                             donate_argnames=("state",))
_decode_jit = DiskCachedJit(_decode, name="generate_decode", static_argnames=("graphdef", "stochastic"),
                            donate_argnames=("state",))


class Generator:
    """Batched autoregressive generation with a target model split into (graphdef, params)."""

    def __init__(self, config: TargetConfig, graphdef: nnx.GraphDef, params: nnx.State):
        # cheap to pass on every step: GraphDef hashed once, params a plain dict (hyspec_jax.compilation)
        self.config, self.graphdef, self.params = config, static_graphdef(graphdef), pure_params(params)
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype if leaves else jnp.float32
        self.watch = CompileWatch()

    @property
    def compilations_after_startup(self) -> int:
        """XLA compilations since the end of `warmup` / `compile_buckets` (never warmed up: since construction)."""
        return self.watch.since

    @classmethod
    def from_model(cls, model) -> "Generator":
        graphdef, params = nnx.split(model)
        return cls(model.config, graphdef, params)

    def new_state(self, batch: int, max_len: int) -> TargetState:
        return init_state(self.config, batch, max_len, self.dtype)

    # device calls: `generate` and `compile_buckets` share them, so start-up compiles exactly what generate runs
    def _prefill_call(self, state, tokens: np.ndarray, valid: np.ndarray, sampling: SlotSampling,
                      stochastic: bool):
        return _prefill_jit(self.graphdef, self.params, state, np.asarray(tokens), np.asarray(valid), sampling,
                            stochastic=stochastic)

    def _decode_call(self, state, nxt, active: np.ndarray, sampling: SlotSampling, step: int, stochastic: bool):
        # host arrays go straight to the jitted call (cheaper than a jnp.asarray dispatch each); `active` is
        # copied because the caller updates it in place while the step may still be running
        nxt, state = _decode_jit(self.graphdef, self.params, state, nxt, np.array(active), sampling,
                                 np.asarray(step, np.int32), stochastic=stochastic)
        # start the token's device→host copy as soon as this step is done, so that reading it after the next
        # step was dispatched (the pipelined loop) does not wait behind that step's work as well
        start_host_copy(nxt)
        return nxt, state

    def compile_buckets(self, buckets: Iterable[tuple[int, int]], prompt_lengths: Sequence[int] | None = None,
                        progress: bool = True, cache: bool = True, stochastic: Sequence[bool] = (False, True)) -> int:
        """Compile every program of the (batch slots, KV length) buckets — the prefill of each prompt bucket T < S
        (of prompt_lengths; default: all of them, `prompt_buckets`) and the decode step — then mark start-up. A request batch of n
        prompts runs in slots bucket(n, 1), prompt bucket bucket(longest prompt), KV bucket(T + max_tokens, 128).
        cache: use JAX's persistent compilation cache. stochastic: the sampling flavours to compile (greedy
        batches and sampling ones run separate programs). Returns the number of programs compiled."""
        if cache:
            use_compilation_cache()
        jobs = []
        for B, S in buckets:
            ts = [t for t in (sorted({bucket(n) for n in prompt_lengths}) if prompt_lengths
                              else prompt_buckets(S - 1)) if t < S]
            jobs += [(B, S, t, bool(r)) for r in stochastic for t in [*ts, None]]
        watch = CompileWatch()
        bar = compile_progress(len(jobs), progress)
        nxt = state = None
        for B, S, T, r in jobs:
            bar.set_postfix_str(f"slots {B}, kv {S}, " + (f"prefill {T}" if T is not None else "decode")
                                + (", sampling" if r else ", greedy"))
            sampling = SlotSampling.from_params([], B)
            if T is not None:
                nxt, state = self._prefill_call(self.new_state(B, S), np.zeros((B, T), np.int32),
                                                np.zeros((B, T), bool), sampling, r)
            else:
                if state is None:
                    nxt, state = self._prefill_call(self.new_state(B, S), np.zeros((B, 16), np.int32),
                                                    np.zeros((B, 16), bool), sampling, r)
                nxt, state = self._decode_call(state, nxt, np.zeros(B, bool), sampling, 1, r)
                jax.block_until_ready(nxt)
                nxt = state = None
            bar.update(1)
        bar.close()
        self.watch.mark()
        return watch.since

    def warmup(self, batch: int = 1, kv_len: int = 128, progress: bool = True, cache: bool = True,
               stochastic: Sequence[bool] = (False, True)) -> int:
        """Start-up compile of one bucket (batch slots, KV length) with every prompt bucket; see compile_buckets."""
        return self.compile_buckets([(bucket(batch, 1), kv_len)], progress=progress, cache=cache,
                                    stochastic=stochastic)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for a batch of ragged prompts. `on_tokens(request_index, new_ids)` streams tokens."""
        if not prompts:
            return []
        n = len(prompts)
        plist = validate_prompts(prompts, params, self.config.vocab_size)
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
        stochastic = any(p.temperature > 0 for p in plist)
        stops = [set(p.stop_token_ids) for p in plist]
        out: list[list[int]] = [[] for _ in range(n)]
        finish = [""] * n
        t0 = time.perf_counter()
        nxt, state = self._prefill_call(self.new_state(B, S), tokens, valid, sampling, stochastic)
        nxt_host = np.asarray(nxt)
        t_prefill = time.perf_counter() - t0
        active = np.zeros(B, bool)
        active[:n] = True
        step = 0
        t_warm = None
        # Steps are pipelined: step s+1 is dispatched before the host reads step s's tokens, so the host's work
        # overlaps the device's. A request that stops on a stop token costs its slot one discarded step; no step
        # is dispatched ahead when a request could reach max_tokens with the tokens of the step in flight.
        inflight = None                   # device tokens of the step dispatched and not yet read
        reads = 0
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
            if inflight is None:
                step += 1
                inflight, state = self._decode_call(state, nxt, active, sampling, step, stochastic)
            nxt = inflight
            if all(not active[i] or len(out[i]) + 1 < plist[i].max_tokens for i in range(n)):
                step += 1                 # ahead: step s+1 runs while the host reads step s
                inflight, state = self._decode_call(state, nxt, active, sampling, step, stochastic)
            else:
                inflight = None
            nxt_host = np.asarray(nxt)
            reads += 1
            if t_warm is None:
                t_warm, warm_reads = time.perf_counter(), reads
        t_end = time.perf_counter()
        rate = (reads - warm_reads) / (t_end - t_warm) if t_warm is not None and reads > warm_reads else 0.0
        return [GenerationResult(list(map(int, prompts[i])), out[i], finish[i], t_end - t0, t_prefill, rate)
                for i in range(n)]
