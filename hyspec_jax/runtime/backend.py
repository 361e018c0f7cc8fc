"""Device side of the request loop: the batched slot state and the jitted programs the scheduler calls.

A backend owns B slots of committed state (target state, with a drafter also its context K/V, and the anchors) on
the device, and two kinds of call, each compiled once per static shape:

- `prefill(slots, tokens, valid, reset, sampling)` — prompt chunks [P, T] (one of the backend's static prefill
  shapes) into slots; returns the sampled first tokens (host). Short prompts are packed several to a call; long
  prompts are cut into chunks so that decoding continues between their chunks.
- `dispatch(active, sampling, steps, stochastic)` → a handle, then `collect(handle)` → `StepResult`: one
  decoding step (`ARBackend`) or one speculative round (`SpecBackend`: `hyspec_jax.spec.round`) for every active
  slot. Dispatch returns before the device finishes, so the loop can dispatch the next step before it reads this one.

Both take an optional `penalty` (`SlotPenalty`, per row): the penalized flavour of the program, which also updates
the backend's per-slot penalty history (`PenaltyCounts`, made on first use, in the `SlotState` the program takes);
without it the program is the unpenalized one. The loop passes it while any of the rows' requests has non-neutral
penalties.

The round's static shape is a frozen `RoundShape` per sampling flavour, fixed when the backend is built.

With `SlotLayout.logprobs` = k > 0 every program also computes each emitted token's logprob and top-k alternatives
(`hyspec_jax.logprobs`), read back with the tokens: `read_first` of a prefill's, `StepResult.logprobs` of a step's.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import sys
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hyspec_jax.config import DrafterConfig, TargetConfig
from hyspec_jax.logprobs import TokenLogprobs
from hyspec_jax.runtime.programs import (PrefillChunk, PrefillShape, ar_prefill_jit, ar_step_jit, new_buffers,
                                         spec_prefill_jit, spec_round_io_jit, spread_rows)
from hyspec_jax.sharding import place_buffers
from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, SlotSampling
from hyspec_jax.spec.round import RoundOutput, RoundShape, SlotState, StepInputs

F32 = jnp.float32
MIN_CHUNK = 16      # the smallest prefill length (and prompt bucket)


def bucket(n: int, minimum: int = MIN_CHUNK) -> int:
    """Next power of two ≥ max(n, minimum)."""
    m = max(n, minimum, 1)
    return 1 << (m - 1).bit_length()


def prompt_buckets(longest: int) -> list[int]:
    """The prefill lengths (powers of two ≥ 16) of prompts of 1..longest tokens."""
    out, t = [], MIN_CHUNK
    while longest > 0 and t <= bucket(longest):
        out.append(t)
        t *= 2
    return out


def prefill_shapes(chunk: int, max_rows: int) -> list[tuple[int, int]]:
    """The static (rows, T) prefill shapes for a prefill token budget `chunk` (a power of two ≥ 16)."""
    if chunk < MIN_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"prefill chunk must be a power of two >= {MIN_CHUNK}, got {chunk}")
    out, t = [], MIN_CHUNK
    while t <= chunk:
        out.append((max(1, min(max_rows, chunk // t)), t))
        t *= 2
    return out


def batch_shapes(slots: int, longest_prompt: int) -> list[tuple[int, int]]:
    """The prefill shapes of the synchronous drivers: all `slots` rows, one per prompt bucket up to the longest
    prompt a bucket holds (a batch's prompts are admitted in one call)."""
    return [(slots, t) for t in prompt_buckets(longest_prompt)] or [(slots, bucket(1))]


def check_decode_buckets(buckets: Sequence[int], slots: int, params=None) -> tuple[int, ...]:
    """The decoding buckets below `slots`, sorted (a bucket ≥ slots is the full step, always compiled). None over a
    mesh: the slots are split over the data axis there, and a step over some of them would gather across
    devices."""
    from hyspec_jax.sharding import params_mesh
    out = sorted({int(r) for r in buckets})
    if out and out[0] < 1:
        raise ValueError(f"decoding buckets must be >= 1, got {out[0]}")
    if params is not None and params_mesh(params) is not None:
        return ()
    return tuple(r for r in out if r < slots)


def default_decode_buckets(slots: int) -> tuple[int, ...]:
    """The decoding buckets of a server's slots when none are given: 1 and the powers of 4 below the slots (a
    step over few requests pays for at most 4x their rows, and the programs stay few: 64 slots compile 4 steps
    per flavour)."""
    out, r = [], 1
    while r < slots:
        out.append(r)
        r *= 4
    return tuple(out)


def start_host_copy(x: jax.Array) -> None:
    """Start `x`'s device→host copy now (GPU), so that reading it later does not also wait behind work
    dispatched meanwhile. Not on a CPU: the result already lives in host memory, and the asynchronous copy of a
    buffer still being computed adds a PJRT code path that buys nothing there."""
    if _default_backend() != "cpu":
        x.copy_to_host_async()


@functools.cache
def _default_backend() -> str:
    return jax.default_backend()


def compile_backends(backends: Sequence["Backend"], prompt_lengths: Sequence[int] | None = None,
                     stochastic: Sequence[bool] = (False, True), progress: bool = True) -> None:
    """Start-up compile of every program of these backends (`Backend.compile`) under one progress bar (stderr)."""
    from tqdm import tqdm
    total = sum(len(be.shapes) if prompt_lengths is None else len({bucket(n) for n in prompt_lengths})
                for be in backends) + sum(be.step_programs for be in backends) * len(stochastic)
    bar = tqdm(total=total, desc="compiling", unit="program", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    for be in backends:
        def step(msg: str, be=be) -> None:
            bar.set_postfix_str(f"slots {be.slots}, kv {be.kv_len}, {msg}")
            bar.update(1)
        be.compile(step, stochastic=stochastic, prompt_lengths=prompt_lengths)
    bar.close()


def prefill_chunk(slots, tokens, valid, reset, sampling: SlotSampling, penalty: SlotPenalty | None) -> PrefillChunk:
    """A prefill call's inputs from the loop's host arrays: host arrays go straight to the jitted call (a
    jnp.asarray is one more dispatch each); copies, since the scheduler reuses its buffers."""
    return PrefillChunk(slots=np.array(slots, np.int32), tokens=np.array(tokens, np.int32), valid=np.array(valid, bool),
                        reset=np.array(reset, bool), sampling=sampling, penalty=penalty)


class _Captured(Exception):
    """Raised by `Backend._launch` while `Backend.compile` records the program calls its pass will make."""

    def __init__(self, fn, args, kwargs):
        super().__init__("captured program call")
        self.call = (fn, args, kwargs)


class JitModel(NamedTuple):
    """A model as the jitted programs take it: its config, and graphdef and params as `compilation.split_for_jit`
    returns them."""
    config: TargetConfig | DrafterConfig
    graphdef: object
    params: object


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """A backend's bucket. slots: batch slots; kv_len: positions per slot; shapes: the static (rows, T) prefill
    shapes (`prefill_shapes`, or one (slots, T) per prompt bucket); deferred_rows: the deferred commit's row capacity
    P per slot and GDN layer (0: every step writes the state; `TargetState.pending`); decode_buckets: row counts
    below `slots` a step is also compiled for (`Backend.step_rows`); logprobs: k > 0 — every program also returns
    each emitted token's logprob and its k top alternatives (the server's --max-logprobs), 0 — none computed."""
    slots: int
    kv_len: int
    shapes: tuple[tuple[int, int], ...]
    deferred_rows: int = 0
    decode_buckets: tuple[int, ...] = ()
    logprobs: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        object.__setattr__(self, "decode_buckets", tuple(self.decode_buckets))


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray                    # [B, K] committed tokens per slot (the first count[b] valid)
    count: np.ndarray                     # [B]
    accepted: np.ndarray | None = None    # [B] accepted drafts per slot (speculative modes)
    drafted: int = 0                      # draft tokens verified per active slot this round
    logprobs: TokenLogprobs | None = None  # [B, K] the tokens' logprobs (`SlotLayout.logprobs` > 0)


class Backend(abc.ABC):
    """The slots' device state and the programs over it (see the module docstring)."""

    mode = "ar"
    depth = 0              # most drafts a round commits (0: plain decoding)

    def __init__(self, target: JitModel, layout: SlotLayout,
                 drafter_config: DrafterConfig | TargetConfig | None = None):
        """target: the target model; layout: the bucket (`SlotLayout`); drafter_config: the drafter's (its state is
        made beside the target's), None for none."""
        config, graphdef, params = target
        slots, kv_len, shapes = layout.slots, layout.kv_len, layout.shapes
        deferred_rows, decode_buckets = layout.deferred_rows, layout.decode_buckets
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not shapes:
            raise ValueError("a backend needs at least one prefill shape")
        self.config, self.graphdef, self.params = config, graphdef, params
        leaves = jax.tree.leaves(params)
        self.dtype = leaves[0].dtype if leaves else F32
        self.slots, self.kv_len, self.shapes = slots, kv_len, list(shapes)
        self.deferred_rows = int(deferred_rows)
        self.logprobs = int(layout.logprobs)
        self._drafter_config = drafter_config
        self.reset_buffers()
        self._hist: PenaltyCounts | None = None      # the penalty history, made by the first penalized call
        self.decode_buckets = check_decode_buckets(decode_buckets, slots, params)
        self._compile_rows: int | None = None        # the bucket `compile` is compiling
        self._capturing = False                      # `compile` records program calls instead of running them

    def reset_buffers(self) -> None:
        """The slots' device state, drafter state and last tokens as at construction (fresh, unplaced by any step)."""
        self.state = self.dstate = self.anchor = None           # the old buffers go before the new ones come
        self.state, self.dstate, self.anchor = place_buffers(
            self.config, self.params, *new_buffers(self.config, self._drafter_config, self.slots, self.kv_len,
                                                   self.dtype, self.deferred_rows))

    @property
    def step_programs(self) -> int:
        """Step programs per sampling flavour: one per decoding bucket and one over all slots."""
        return len(self.decode_buckets) + 1

    def step_rows(self, active: np.ndarray) -> np.ndarray | None:
        """The slots a step runs on: None — all of them — unless a decoding bucket below `slots` holds the active
        slots; then those slots, padded to the bucket's size with index `slots` (rows that compute nothing and
        are written nowhere). What vLLM does with its CUDA-graph batch sizes: a step over few requests costs
        the rows it runs, not the server's slots (the state rows it reads and writes, and the kernels' work)."""
        B = self.slots
        if self._compile_rows is not None:
            return None if self._compile_rows >= B else np.full(self._compile_rows, B, np.int32)
        if not self.decode_buckets:
            return None
        live = np.flatnonzero(active)
        R = next((r for r in self.decode_buckets if r >= len(live)), B)
        if R >= B:
            return None
        rows = np.full(R, B, np.int32)
        rows[:len(live)] = live
        return rows

    def penalty_hist(self) -> PenaltyCounts:
        """The slots' penalty history [B, V] (zeros on first use: a penalized request's prefill resets its row)."""
        if self._hist is None:
            from hyspec_jax.sharding import params_device, params_mesh, slot_shardings
            B, V = self.slots, self.config.vocab_size
            host = (np.zeros((B, V), np.int32), np.zeros((B, V), bool))
            mesh = params_mesh(self.params)      # placed like the other per-slot buffers (host values: any process)
            dev = (jax.device_put(host, params_device(self.params)) if mesh is None     # committed: `place_buffers`
                   else tuple(jax.device_put(x, slot_shardings(x, mesh)) for x in host))
            self._hist = PenaltyCounts(*dev)
        return self._hist

    @property
    def overshoot(self) -> int:
        """Positions a step may write past a request's last token (a round commits up to depth + 1 tokens)."""
        return 0

    @property
    def max_context(self) -> int:
        """Longest prompt + completion a slot holds."""
        return self.kv_len - self.overshoot

    def shape_for(self, rows_needed: list[int]) -> tuple[int, int]:
        """Best static shape for chunks of these remaining prompt lengths (FIFO order): most tokens."""
        best, best_tokens = self.shapes[0], -1
        for rows, t in self.shapes:
            n = sum(min(r, t) for r in rows_needed[:rows])
            if n > best_tokens:
                best, best_tokens = (rows, t), n
        return best

    @staticmethod
    def sampling(temperature, top_p, top_k, seed) -> SlotSampling:
        """Per-row sampling parameters as device arrays, made once per distinct set (`SlotSampling.of`)."""
        return SlotSampling.of(temperature, top_p, top_k, seed)

    @staticmethod
    def penalty(presence, frequency, repetition) -> SlotPenalty:
        """Per-row penalty parameters as device arrays, made once per distinct set (`SlotPenalty.of`)."""
        return SlotPenalty.of(presence, frequency, repetition)

    def compile(self, progress: Callable[[str], None] | None = None, stochastic: Sequence[bool] = (False, True),
                prompt_lengths: Sequence[int] | None = None, workers: int | None = None) -> None:
        """Compile (run with no-op inputs: padding rows, no active slot) every prefill shape — those whose T is
        one of prompt_lengths' buckets, default all — and the step of each sampling flavour and decoding bucket.
        `progress(label)` once per program (a step with several widths counts as one).

        With workers > 1 (default `compilation.compile_workers()`) the pass, after its first program, records the
        program calls it will make (`_launch` stops each before it runs) and compiles them side by side on that
        many threads (`compilation.precompile`), without running them (the first request's call only runs its
        program: a warm 2-core start-up ran no-op rounds for seconds).

        Not over a mesh, whose pass repeats until it compiles nothing: XLA may return a buffer in another layout
        than it was placed in (a size-1 mesh axis dropped, the conv window's channels split over "model"), and the
        programs are compiled per input layout — without the repeat the first prefill after a step compiled while
        serving."""
        from hyspec_jax.compilation import CompileWatch, compile_workers
        from hyspec_jax.sharding import params_mesh
        jobs = self._compile_jobs(stochastic, prompt_lengths)
        mesh = params_mesh(self.params) is not None
        workers = compile_workers() if workers is None else int(workers)
        if workers > 1 and not mesh and len(jobs) > 1:
            # the first job runs alone: a program's outputs may be placed unlike the start-up buffers (weights on a
            # 1-device mesh: NamedSharding out, SingleDeviceSharding in), and the calls recorded after it must
            # carry the placement the pass will then pass
            self._run_jobs(jobs[:1], progress)
            failed = self._precompile(jobs[1:], workers, progress)
            # a compiled program needs no run here (the first request's call only runs it): a job runs only where
            # a compile failed, to raise its error now
            self._run_jobs([job for job in jobs[1:] if job[0] in failed], None)
        else:
            self._run_jobs(jobs, progress)
        if not mesh:
            return
        for _ in range(3):
            watch = CompileWatch()
            self._run_jobs(jobs, None)
            if watch.since == 0:
                return

    def _compile_jobs(self, stochastic, prompt_lengths) -> list[tuple[str, int | None, list[Callable[[], object]]]]:
        """The start-up compile as (label, the decoding bucket it runs in or None, calls with no-op inputs)."""
        B = self.slots
        wanted = None if prompt_lengths is None else {bucket(n) for n in prompt_lengths}
        jobs = []
        for rows, t in self.shapes:
            if wanted is not None and t not in wanted:
                continue
            z = np.zeros(rows, np.float32)
            samp = self.sampling(z, np.ones(rows, np.float32), z.astype(np.int32), z.astype(np.uint32))
            jobs.append((f"prefill [{rows}x{t}]", None, [functools.partial(
                self.prefill, np.full(rows, B, np.int32), np.zeros((rows, t), np.int32), np.zeros((rows, t), bool),
                np.zeros(rows, bool), samp)]))
        for flavour in stochastic:
            samp = self.sampling(np.full(B, 1.0 if flavour else 0.0, np.float32), np.ones(B, np.float32),
                                 np.zeros(B, np.int32), np.zeros(B, np.uint32))
            for rows in list(self.decode_buckets) + [B]:
                jobs.append((f"{self.describe_step(rows)} [{rows}, {'sampling' if flavour else 'greedy'}]", rows,
                             self._warm_steps(samp, bool(flavour), rows)))
        return jobs

    def _warm_steps(self, sampling: SlotSampling, stochastic: bool, rows: int) -> list[Callable[[], object]]:
        """The calls that compile the step of one sampling flavour over `rows` rows (the bucket `compile` sets): one
        no-op step."""
        B = self.slots
        return [lambda: self.collect(self.dispatch(np.zeros(B, bool), sampling, np.zeros(B, np.int32), stochastic))]

    def _run_jobs(self, jobs, progress, capture: list | None = None) -> None:
        """Run the compile jobs; with `capture`, record each call's program call (fn, args, kwargs) instead."""
        for label, rows, calls in jobs:
            t0 = time.perf_counter()
            self._compile_rows = rows
            try:
                for call in calls:
                    if capture is None:
                        call()
                        continue
                    self._capturing = True
                    try:
                        call()
                    except _Captured as c:
                        capture.append((label, c.call))
                    finally:
                        self._capturing = False
            finally:
                self._compile_rows = None
            if progress:
                progress(f"{label} {time.perf_counter() - t0:.1f}s")

    def _precompile(self, jobs, workers: int, progress) -> set[str]:
        """Compile the program calls of these jobs side by side (`compilation.precompile`); returns the labels of
        the jobs where one failed."""
        from hyspec_jax.compilation import precompile
        captured: list = []
        failed: set[str] = set()
        self._run_jobs(jobs, None, capture=captured)
        left = collections.Counter(label for label, _ in captured)
        spent = collections.Counter()

        def done(i: int, seconds: float | None) -> None:    # a job's time: its calls' compile time, in their threads
            label = captured[i][0]
            left[label] -= 1
            spent[label] += seconds or 0.0
            if seconds is None:
                failed.add(label)
            if left[label] == 0 and progress:
                progress(f"{label} {spent[label]:.1f}s")
        precompile([c for _, c in captured], workers, done)
        if progress:
            for label, _, _ in jobs:
                if label not in left:               # made no program call: nothing compiled ahead
                    progress(f"{label} 0.0s")
        return failed

    def describe_step(self, rows: int | None = None) -> str:
        """What one step of this backend over `rows` rows runs (the start-up compile's log)."""
        return "decode"

    # --- to implement ------------------------------------------------------------------------------
    @abc.abstractmethod
    def prefill(self, slots: np.ndarray, tokens: np.ndarray, valid: np.ndarray, reset: np.ndarray,
                sampling: SlotSampling, penalty: SlotPenalty | None = None) -> jax.Array | np.ndarray:
        """Run prompt chunks [P, T] into slots `slots` [P] (B = padding row), not waiting for it; returns the
        sampled next tokens [P] as an array the loop reads (`np.asarray`, then `programs.read_first`: with logprobs they
        come packed beside the tokens) once it has dispatched the next step (a device array whose host copy has
        started, or a host array). A slot's next token is also kept on the device, so that step does not need
        it."""

    @abc.abstractmethod
    def dispatch(self, active: np.ndarray, sampling: SlotSampling, steps: np.ndarray, stochastic: bool,
                 penalty: SlotPenalty | None = None):
        """Dispatch one step for every active slot (not waiting for it); returns the handle `collect` reads."""

    def _slots(self, penalized: bool) -> SlotState:
        """The slot state a program takes (the penalty history only for the penalized flavour)."""
        return SlotState(target=self.state, drafter=self.dstate, hist=self.penalty_hist() if penalized else None)

    def _keep(self, slots: SlotState) -> None:
        """Hold the slot state a program returned (its inputs were donated)."""
        self.state, self.dstate = slots.target, slots.drafter
        if slots.hist is not None:
            self._hist = slots.hist

    def _launch(self, fn, *args, **kw):
        """fn(*args, **kw): fn's outputs. Every program call of a backend goes through here, so `compile` can
        record them (`_Captured`)."""
        if self._capturing:
            raise _Captured(fn, args, kw)
        return fn(*args, **kw)

    @abc.abstractmethod
    def collect(self, handle) -> StepResult:
        """Wait for a dispatched step and read its committed tokens."""


class ARBackend(Backend):
    """Plain autoregressive decoding: one token per active slot and step."""

    mode = "ar"

    def prefill(self, slots, tokens, valid, reset, sampling, penalty=None) -> jax.Array:
        first, out, self.anchor = self._launch(
            ar_prefill_jit, self.graphdef, self.params, self._slots(penalty is not None), self.anchor,
            prefill_chunk(slots, tokens, valid, reset, sampling, penalty), logprobs=self.logprobs)
        self._keep(out)
        start_host_copy(first)
        return first

    def dispatch(self, active, sampling, steps, stochastic, penalty=None):
        active = np.array(active, bool)
        inputs = StepInputs(StepInputs.pack(active, steps, 0, self.step_rows(active)), sampling, penalty)
        self.anchor, out, lps = self._launch(ar_step_jit, self.graphdef, self.params,
                                             self._slots(penalty is not None), self.anchor, inputs,
                                             stochastic=bool(stochastic), logprobs=self.logprobs)
        self._keep(out)
        start_host_copy(self.anchor)
        if lps is not None:
            start_host_copy(lps)
        return self.anchor, active, lps

    def collect(self, handle) -> StepResult:
        tokens, active, lps = handle
        return StepResult(tokens=np.asarray(tokens)[:, None], count=active.astype(np.int32),
                          logprobs=None if lps is None else TokenLogprobs.unpack(np.asarray(lps), self.logprobs))


class SpecBackend(Backend):
    """Speculative decoding: one round (draft → select → verify → accept → commit) per step."""

    def __init__(self, target: JitModel, drafter: JitModel, layout: SlotLayout, *, mode: str,
                 round_shapes: dict[bool, RoundShape], capacity: int):
        """drafter: the DSpark drafter, or for an MTP head the target's config with the head's graphdef and params.
        round_shapes: the frozen round shape of the greedy (False) and the sampling (True) flavour. capacity: the
        batch-wide node budget C. layout: as `Backend` (a round commits up to depth + 1 rows: its deferred_rows
        must hold them; a packed round's rows are the whole batch's, so those run over all slots)."""
        depth = round_shapes[False].depth
        if 0 < layout.deferred_rows < depth + 1:
            raise ValueError(f"deferred_rows {layout.deferred_rows} cannot hold one round's accepted path "
                             f"({depth + 1} rows)")
        g = round_shapes[False]
        if g.packed_rows or g.packed_gains:    # their rows are the whole batch's
            layout = dataclasses.replace(layout, decode_buckets=())
        super().__init__(target, layout, drafter_config=drafter.config)
        self.mode, self.dgraph, self.dparams = mode, drafter.graphdef, drafter.params
        self.round_shapes = self.with_logprobs(round_shapes)
        greedy = self.round_shapes[False]
        self.depth, self.verify_nodes = greedy.depth, greedy.verify_nodes
        self.drafted = greedy.verify_nodes - 1
        self.capacity = int(capacity)
        self.prefill_shape = PrefillShape(greedy.tap_layers, self.logprobs)

    @property
    def overshoot(self) -> int:
        return self.round_shapes[False].gamma + 2

    def with_logprobs(self, shapes: dict[bool, RoundShape]) -> dict[bool, RoundShape]:
        """The round shapes computing this backend's logprobs (`SlotLayout.logprobs`)."""
        return {s: dataclasses.replace(shape, logprobs=self.logprobs) for s, shape in shapes.items()}

    def describe_step(self, rows: int | None = None) -> str:
        return f"{self.mode} round N={self.verify_nodes}"

    def prefill(self, slots, tokens, valid, reset, sampling, penalty=None) -> jax.Array:
        first, out, self.anchor = self._launch(
            spec_prefill_jit, self.graphdef, self.params, self.dgraph, self.dparams, self._slots(penalty is not None),
            self.anchor, prefill_chunk(slots, tokens, valid, reset, sampling, penalty),
            shape=self.prefill_shape)
        self._keep(out)
        start_host_copy(first)
        return first

    def dispatch(self, active, sampling, steps, stochastic, penalty=None):
        active = np.asarray(active, bool)
        rows = self.step_rows(active)
        return self._round(self.round_shapes[bool(stochastic)], self.capacity, active, sampling, steps, penalty,
                           rows), rows

    def _round(self, shape: RoundShape, capacity: int, active: np.ndarray, sampling: SlotSampling, steps,
               penalty: SlotPenalty | None, rows: np.ndarray | None) -> jax.Array:
        """Launch one round of this shape over `rows` (None: every slot): its packed `RoundOutput`, whose host copy
        has started."""
        inputs = StepInputs(StepInputs.pack(active, steps, capacity, rows), sampling, penalty)
        out, self.anchor, host_out = self._launch(
            spec_round_io_jit, self.graphdef, self.params, self.dgraph, self.dparams, self._slots(penalty is not None),
            self.anchor, inputs, shape=shape)
        self._keep(out)
        start_host_copy(host_out)     # the host reads it: start its copy now
        return host_out

    def collect(self, handle) -> StepResult:
        host_out, rows = handle
        out = RoundOutput.unpack(spread_rows(np.asarray(host_out), rows, self.slots), 0, self.logprobs)  # one transfer
        return StepResult(tokens=out.tokens, count=out.count, accepted=out.accepted, drafted=self.drafted,
                          logprobs=out.logprobs)
