"""Plain autoregressive generation (the `ar` baseline and the losslessness oracle for speculation): a synchronous
driver of the request loop (`hyspec_jax.runtime`).

Static shapes: batch slots, prompt length and KV length are rounded up to buckets, so a generation never
recompiles after its first step; the state buffer is donated to every step. `Generator.compile_buckets` /
`warmup` compile buckets ahead of time (start-up); `compilations_after_startup` counts what compiled since.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax.compilation import CompileWatch, enable_compilation_cache, pure_params, static_graphdef
from hyspec_jax.config import TargetConfig
from hyspec_jax.runtime.backend import ARBackend, batch_shapes, bucket, compile_backends
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.state import TargetState, init_state


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


def default_slots(requests: int, params) -> int:
    """The slots of a batch of `requests` when none are asked for: bucket(requests, 1), rounded up to a multiple
    of the weights' data-parallel replicas (`sharding.data_parallel_size`; each replica decodes an equal share)."""
    from hyspec_jax.sharding import data_parallel_size
    replicas = data_parallel_size(params)
    return -(-bucket(requests, 1) // replicas) * replicas


class Generator:
    """Batched autoregressive generation with a target model split into (graphdef, params): a synchronous driver
    of the request loop (`hyspec_jax.runtime`) over an `ARBackend`."""

    def __init__(self, config: TargetConfig, graphdef: nnx.GraphDef, params: nnx.State, deferred_rows: int = 0):
        """deferred_rows: P > 0 — a decoding step appends its GDN rows to each slot's ring and writes the states only
        when a ring is full (`TargetState.pending`); 0 — every step writes them."""
        # cheap to pass on every step: GraphDef hashed once, params a plain dict (hyspec_jax.compilation)
        self.config, self.graphdef, self.params = config, static_graphdef(graphdef), pure_params(params)
        if deferred_rows < 0:
            raise ValueError("deferred_rows must be >= 0")
        self.deferred_rows = int(deferred_rows)
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype if leaves else jnp.float32
        self.watch = CompileWatch()

    @property
    def compilations_after_startup(self) -> int:
        """XLA compilations since the end of `warmup` / `compile_buckets` (never warmed up: since construction)."""
        return self.watch.since

    @classmethod
    def from_model(cls, model, deferred_rows: int = 0) -> "Generator":
        graphdef, params = nnx.split(model)
        return cls(model.config, graphdef, params, deferred_rows)

    def new_state(self, batch: int, max_len: int) -> TargetState:
        return init_state(self.config, batch, max_len, self.dtype, self.deferred_rows)

    def backend(self, slots: int, kv_len: int, shapes: Sequence[tuple[int, int]] | None = None,
                decode_buckets: Sequence[int] = ()) -> ARBackend:
        """A backend for the bucket (slots, KV length); prefill shapes default to all `slots` rows of every prompt
        bucket the KV length holds; decoding buckets: the row counts below `slots` a step is also compiled for
        (`Backend.step_rows`)."""
        return ARBackend(self.config, self.graphdef, self.params, slots=slots, kv_len=kv_len,
                         shapes=shapes or batch_shapes(slots, kv_len - 1), deferred_rows=self.deferred_rows,
                         decode_buckets=decode_buckets)

    def compile_buckets(self, buckets: Iterable[tuple[int, int]], prompt_lengths: Sequence[int] | None = None,
                        progress: bool = True, cache: bool = True, stochastic: Sequence[bool] = (False, True)) -> int:
        """Compile every program of the (batch slots, KV length) buckets — the prefill of each prompt bucket T < S
        (of prompt_lengths; default: all of them, `prompt_buckets`) and the decode step — then mark start-up. A
        request batch of n prompts runs in slots default_slots(n), prompt bucket bucket(longest prompt), KV
        bucket(T + max_tokens, 128). cache: use JAX's persistent compilation cache. stochastic: the sampling
        flavours of the decode step to compile (greedy batches and sampling ones run separate programs). Returns
        the number of programs compiled."""
        if cache:
            use_compilation_cache()
        watch = CompileWatch()
        compile_backends([self.backend(B, S) for B, S in buckets], prompt_lengths, stochastic, progress)
        self.watch.mark()
        return watch.since

    def warmup(self, batch: int = 1, kv_len: int = 128, progress: bool = True, cache: bool = True,
               stochastic: Sequence[bool] = (False, True)) -> int:
        """Start-up compile of one bucket (batch slots, KV length) with every prompt bucket; see compile_buckets."""
        return self.compile_buckets([(default_slots(batch, self.params), kv_len)], progress=progress, cache=cache,
                                    stochastic=stochastic)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_tokens: Callable[[int, list[int]], None] | None = None, *, slots: int | None = None,
                 kv_len: int | None = None) -> list[GenerationResult]:
        """Generate for a batch of ragged prompts. `on_tokens(request_index, new_ids)` streams tokens. slots /
        kv_len fix the bucket (default: `default_slots(#prompts)`, KV bucket(prompt bucket + max_tokens, 128))."""
        if not prompts:
            return []
        plist = validate_prompts(prompts, params, self.config.vocab_size)
        B = slots or default_slots(len(prompts), self.params)
        T = bucket(max(len(p) for p in prompts))
        need = T + max(p.max_tokens for p in plist)
        S = kv_len or bucket(need, 128)
        if max(len(p) for p in prompts) + max(p.max_tokens for p in plist) > S:
            raise ValueError(f"kv_len {S} is too short for the prompts + max_tokens")
        t0 = time.perf_counter()
        reqs, outs, loop = run_batch(self.backend(B, S), prompts, plist, on_tokens)
        seconds = time.perf_counter() - t0
        return [GenerationResult(list(map(int, p)), outs[i], r.finish_reason, seconds, loop.prefill_seconds,
                                 loop.warm_steps_per_second)
                for i, (p, r) in enumerate(zip(prompts, reqs))]
