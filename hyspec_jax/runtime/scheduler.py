"""The request loop: continuous batching over a `Backend`, the one host loop of the library and the server.

Per iteration: drop aborted requests (a disconnected client, a stop string the front end saw) and free their
slots; admit waiting requests into free slots; run one prefill call (chunks of one or more prompts, packed into
one of the backend's static prefill shapes); then dispatch or collect one decoding step (AR token or speculative
round) for every slot that is decoding. A long prompt therefore advances one chunk per iteration while the other
slots keep decoding. Stop token ids and max_tokens are applied here, exactly, also inside a multi-token
speculative round (`EngineRequest.cut` is the one home of that rule); stop strings are text, applied by the
front end, which then aborts the request. A device call whose rows include a request with penalties runs the
backend's penalized flavour (the penalty history lives on the device, so pipelining is unchanged).

Steps are pipelined: the next step is dispatched before the host reads the one in flight, so the host's work
(dispatch, streaming, bookkeeping) overlaps the device's. So are prefill calls: a prompt's first token is read only
after the next step went out (the device keeps each slot's last token, so that step does not need it), so the device
runs the prefill and then that step without waiting for the host between them; the first token is sent before that
step's tokens. A request whose first token stops it wastes its row of that step. A slot's outputs are used only
while the request that owned it at dispatch still runs: a request that stops on a stop token in the step in flight
costs its slot one discarded step, and so does one that reaches max_tokens in it. No step is dispatched ahead when
every request likely reaches max_tokens in the step in flight (it commits as many tokens as the request's recent
steps did: the step ahead would likely be wasted), or when a row could then pass its slot's context.

Two drivers: the server runs the loop on its own thread (`start`, `submit`, `abort`, `drain`), and
`run_until_idle` runs it on the caller's thread until every submitted request has finished (`hyspec generate`,
`Engine.generate`). Requests talk to their owner through
`sink(token_ids, finish_reason | None, logprobs)`, called on the loop's thread — logprobs: the tokens' `TokenScores`
as the programs computed them, for a request that asks (`EngineRequest.logprobs`) of a backend that computes them
(`SlotLayout.logprobs`), else None; an optional `LoopObserver` sees every event
(the server's metrics). `on_batch()`, where given, is called on the loop's thread after the sink calls of each
iteration (a prefill's first tokens, a step's tokens), so that a front end on another thread can take them with one
wake-up, after the loop's host work for that iteration (not one per request, competing with it for the GIL).
A loop that fails (a device error: out of memory, a lost GPU) fails every request it holds or queues, takes no more
(`submit` raises `ShuttingDown`), keeps the error in `failed` and calls `on_failure(error)` once, where given (the
server then stops: a dead engine must not look alive).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np

from hyspec_jax.logprobs import TokenLogprobs, TokenScores
from hyspec_jax.runtime.backend import Backend, StepResult
from hyspec_jax.runtime.programs import read_first
from hyspec_jax.sampling import penalized

log = logging.getLogger("hyspec.runtime")

Sink = Callable[[list[int], str | None, TokenScores | None], None]
_ids = itertools.count()


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class LoopObserver:
    """What the loop reports (no-op here; the server's metrics override these)."""

    def occupancy(self, running: int, waiting: int, slots: int) -> None:
        """Requests holding a slot and waiting for one."""

    def admitted(self, queue_seconds: float) -> None:
        """A request got a slot after queue_seconds."""

    def engine_call(self, kind: str) -> None:
        """One device call: kind "prefill" or "decode" (a decoding step or a speculative round)."""

    def dispatched_ahead(self) -> None:
        """A decoding step went out before the one in flight was read (pipelined)."""

    def prefill_time(self, seconds: float) -> None:
        """A prefill call held the loop for `seconds`: its dispatch and the wait to read its first tokens."""

    def decode_host_time(self, dispatch: float, collect: float) -> None:
        """Of one decoding step (or round), the loop's seconds in its dispatch (argument handling, launching its
        kernels) and in its collect (waiting for the device to finish it, then reading it back). A collect
        that hardly waits means the host, not the device, sets the step's period."""

    def prompt_done(self, prompt_tokens: int) -> None:
        """A request's prompt is fully prefilled."""

    def tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        """n tokens given to a request; ttft for its first, else itl since its last."""

    def step_done(self) -> None:
        """The events of one loop iteration (a prefill's first tokens, a step's tokens) are all reported: an
        observer may record them now, once per iteration rather than once per request."""

    def finished(self, reason: str, e2e_seconds: float, aborted: bool) -> None:
        """A request ended: "stop" / "length" / "abort" / "error"."""

    def spec_round(self, active: int, drafted: int, accepted: np.ndarray, depth: int) -> None:
        """A speculative round over `active` requests, `drafted` drafts each; accepted [active]."""


@dataclasses.dataclass(eq=False)
class EngineRequest:
    prompt_ids: list[int]
    max_tokens: int
    sink: Sink
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False      # the sink gets the tokens' logprobs (where the backend computes them)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    # loop-owned
    slot: int = -1
    prefilled: int = 0
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    abort_reason: str | None = None     # set by abort(): "abort" (client left) or "stop" (stop string)
    committed: list[int] = dataclasses.field(default_factory=list)   # tokens committed per step (bonus incl.)
    accepted: list[int] = dataclasses.field(default_factory=list)    # drafts accepted per speculative round

    @property
    def penalized(self) -> bool:
        return penalized(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @property
    def decoding(self) -> bool:
        return self.slot >= 0 and self.prefilled >= len(self.prompt_ids)

    def cut(self, toks: Sequence[int]) -> tuple[list[int], str | None]:
        """The tokens of `toks` this request keeps — up to and including a stop token, at most max_tokens in all —
        and the finish reason they reach ("stop", "length") or None."""
        room = self.max_tokens - self.generated
        out = [int(t) for t in toks[:room]]
        for i, t in enumerate(out):
            if t in self.stop_token_ids:
                return out[:i + 1], "stop"
        return out, "length" if len(out) == room else None


class Scheduler:
    """The request loop over one backend (see the module docstring)."""

    def __init__(self, backend: Backend, observer: LoopObserver | None = None, *, max_queue: int = 1 << 30,
                 on_batch: Callable[[], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.backend = backend
        self.observer = observer or LoopObserver()
        self.max_queue = max_queue
        self.on_batch = on_batch
        self.on_failure = on_failure
        B = backend.slots
        self.slots: list[EngineRequest | None] = [None] * B
        self.waiting: deque[EngineRequest] = deque()
        self.cv = threading.Condition()
        self.accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        # per-slot host mirrors of the device-side sampling inputs
        self.steps = np.zeros(B, np.int32)
        self.temperature = np.zeros(B, np.float32)
        self.top_p = np.ones(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.seed = np.zeros(B, np.uint32)
        self.presence = np.zeros(B, np.float32)
        self.frequency = np.zeros(B, np.float32)
        self.repetition = np.ones(B, np.float32)
        self._sampling = None            # device SlotSampling of the step (rebuilt on changes)
        self._penalty = None             # device SlotPenalty of the step, while a decoding request is penalized
        self._lists = None               # (decoding requests, any prefilling, active mask) until the slots change
        self._attention = False          # an abort or a submission waits for the loop's lock
        # (handle, owners at dispatch, the dispatch's seconds)
        self._inflight: tuple[object, list[EngineRequest | None], float] | None = None
        # a prefill call whose first tokens are not read yet: (its output, (row, request) of each prompt it ended,
        # the loop's time spent on it so far)
        self._firsts: tuple[object, list[tuple[int, EngineRequest]], float] | None = None
        self.failed: BaseException | None = None
        # totals since construction (the synchronous drivers' statistics)
        self.steps_collected = 0
        self.steps_ahead = 0             # steps dispatched before the one in flight was read (pipelined)
        self.prefill_seconds = 0.0
        self.first_collect_at: float | None = None
        self.last_collect_at: float | None = None

    # --- front-end API (any thread) -----------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        with self.cv:
            if not self.accepting:
                raise ShuttingDown()
            # requests beyond the free slots wait; at most max_queue of them
            free = sum(s is None for s in self.slots)
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull()
            self.waiting.append(req)
            self._attention = True
            self._occupancy()
            self.cv.notify()

    def abort(self, req: EngineRequest, reason: str = "abort") -> None:
        with self.cv:
            if not req.finished and req.abort_reason is None:
                req.abort_reason = reason
                self._attention = True
                self.cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hyspec-scheduler", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Stop accepting; the thread exits once every admitted and waiting request has finished."""
        with self.cv:
            self.accepting = False
            self.cv.notify()

    def stop(self) -> None:
        """Stop now: abort everything (used after a drain timeout)."""
        with self.cv:
            self.accepting = False
            self._stop = True
            self.cv.notify()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def warm_steps_per_second(self) -> float:
        """Steps (rounds) collected per second after the first, compiling one (0 with fewer than two)."""
        if self.steps_collected < 2 or self.last_collect_at <= self.first_collect_at:
            return 0.0
        return (self.steps_collected - 1) / (self.last_collect_at - self.first_collect_at)

    @property
    def busy(self) -> bool:
        with self.cv:
            return self._has_work()

    # --- the loop ------------------------------------------------------------------------------------
    def run_until_idle(self) -> None:
        """Run the loop on this thread until every submitted request has finished (the synchronous driver)."""
        while True:
            if self._attention or self.waiting:      # only then is there anything to free or admit
                with self.cv:
                    self._attention = False
                    self._reap()
                    self._admit()
            if not self._has_work():
                return
            self._iterate()

    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    self._reap()
                    self._occupancy()
                    while not self._has_work() and not self._stop and self.accepting:
                        self.cv.wait()
                    if self._stop:
                        self._abort_all("abort")
                        return
                    if not self.accepting and not self._has_work():
                        return
                    self._attention = False
                    self._reap()
                    self._admit()
                self._iterate()
        except BaseException as e:  # noqa: BLE001 - fail requests, never hang them
            log.exception("scheduler failed")
            self.failed = e
            with self.cv:
                self.accepting = False
                self._abort_all("error")
            if self.on_failure is not None:
                try:
                    self.on_failure(e)
                except Exception:  # noqa: BLE001
                    log.exception("on_failure failed")

    def _iterate(self) -> None:
        if self._slot_lists()[1]:
            self._prefill()
        self._step()                     # reads the prefill's first tokens too
        self._batch_done()

    def _batch_done(self) -> None:
        self.observer.step_done()
        if self.on_batch is not None:
            try:
                self.on_batch()
            except Exception:  # noqa: BLE001
                log.exception("on_batch failed")

    def _changed(self) -> None:
        """The slots' requests or their phase changed: drop what was derived from them."""
        self._sampling = self._lists = self._penalty = None
        self._occupancy()

    def _slot_lists(self) -> tuple[list[EngineRequest], bool, np.ndarray]:
        """(the decoding requests, whether a request is being prefilled, the active mask of a step)."""
        if self._lists is None:
            decoding = [r for r in self.slots if r is not None and r.decoding and not r.finished]
            active = np.zeros(len(self.slots), bool)
            active[[r.slot for r in decoding]] = True
            self._lists = (decoding, any(r is not None and not r.decoding for r in self.slots), active)
        return self._lists

    def _has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots) or self._inflight is not None

    def _occupancy(self) -> None:
        self.observer.occupancy(sum(s is not None for s in self.slots), len(self.waiting), len(self.slots))

    def _abort_all(self, reason: str) -> None:
        for r in list(self.waiting) + [s for s in self.slots if s is not None]:
            self._finish(r, reason)
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        self._inflight = self._firsts = None
        self._changed()
        self._batch_done()

    def _reap(self) -> None:
        """Free the slots of aborted requests (called with the lock held)."""
        if any(r.abort_reason for r in self.waiting):
            keep = deque()
            for r in self.waiting:
                if r.abort_reason:
                    self._finish(r, r.abort_reason, notify=False)
                else:
                    keep.append(r)
            self.waiting = keep
        for b, r in enumerate(self.slots):
            if r is not None and r.abort_reason:
                self._finish(r, r.abort_reason, notify=False)
                self.slots[b] = None
                self._changed()

    def _admit(self) -> None:
        for b in range(len(self.slots)):
            if not self.waiting:
                return
            if self.slots[b] is None:
                r = self.waiting.popleft()
                r.slot, r.prefilled = b, 0
                self.slots[b] = r
                self.temperature[b], self.top_p[b], self.top_k[b] = r.temperature, r.top_p, r.top_k
                self.seed[b] = r.seed % (1 << 32)
                self.presence[b], self.frequency[b] = r.presence_penalty, r.frequency_penalty
                self.repetition[b] = r.repetition_penalty
                self.steps[b] = 0
                self._changed()
                self.observer.admitted(time.perf_counter() - r.arrival)

    def _finish(self, r: EngineRequest, reason: str, notify: bool = True) -> None:
        if r.finished:
            return
        r.finished, r.finish_reason = True, reason
        self.observer.finished(reason, time.perf_counter() - r.arrival,
                               r.abort_reason is not None or reason in ("abort", "error"))
        if notify:
            try:
                r.sink([], reason, None)
            except Exception:  # noqa: BLE001
                log.exception("sink failed")

    def _emit(self, r: EngineRequest, toks: Sequence[int], lps: TokenLogprobs | None, row: int) -> bool:
        """Give r its new tokens (with their logprobs: row `row` of lps, where r asks), cut at a stop token or
        max_tokens. True when r finished."""
        out, reason = r.cut(toks)
        r.generated += len(out)
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
            self.observer.tokens(len(out), now - r.arrival, None)
        else:
            self.observer.tokens(len(out), None, now - r.last_token_at)
        r.last_token_at = now
        if reason is not None:
            r.finished, r.finish_reason = True, reason
            self.observer.finished(reason, now - r.arrival, False)
        try:
            r.sink(out, reason, lps.scores(row, len(out)) if r.logprobs and lps is not None else None)
        except Exception:  # noqa: BLE001
            log.exception("sink failed")
        return reason is not None

    def _release(self, b: int) -> None:
        with self.cv:
            self.slots[b] = None
            self._changed()

    # --- device calls --------------------------------------------------------------------------------
    def _prefill(self) -> None:
        be = self.backend
        pending = sorted((r for r in self.slots if r is not None and not r.decoding), key=lambda r: r.arrival)
        rows, T = be.shape_for([len(r.prompt_ids) - r.prefilled for r in pending])
        chosen = pending[:rows]
        B = be.slots
        slots = np.full(rows, B, np.int32)
        tokens = np.zeros((rows, T), np.int32)
        valid = np.zeros((rows, T), bool)
        reset = np.zeros(rows, bool)
        temp, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k, seed = np.zeros(rows, np.int32), np.zeros(rows, np.uint32)
        for i, r in enumerate(chosen):
            chunk = r.prompt_ids[r.prefilled:r.prefilled + T]
            slots[i], reset[i] = r.slot, r.prefilled == 0
            tokens[i, :len(chunk)], valid[i, :len(chunk)] = chunk, True
            b = r.slot
            temp[i], top_p[i], top_k[i], seed[i] = self.temperature[b], self.top_p[b], self.top_k[b], self.seed[b]
        pen = {}
        if any(r.penalized for r in chosen):
            ix = [r.slot for r in chosen] + [0] * (rows - len(chosen))
            pick = lambda x, neutral: np.where(np.arange(rows) < len(chosen), x[ix], neutral)  # noqa: E731
            pen = {"penalty": be.penalty(pick(self.presence, 0.0), pick(self.frequency, 0.0),
                                         pick(self.repetition, 1.0))}
        t0 = time.perf_counter()
        first = be.prefill(slots, tokens, valid, reset, be.sampling(temp, top_p, top_k, seed), **pen)
        self.observer.engine_call("prefill")
        for i, r in enumerate(chosen):
            r.prefilled += int(valid[i].sum())
        self._lists = None               # rows whose prompt is done decode from the next step on
        self._firsts = (first, [(i, r) for i, r in enumerate(chosen) if r.decoding], time.perf_counter() - t0)

    def _read_firsts(self) -> None:
        """Read the pending prefill call's first tokens (waiting for it) and send those of the prompts it ended."""
        if self._firsts is None:
            return
        first, ended, dt = self._firsts
        self._firsts = None
        t0 = time.perf_counter()
        first, lps = read_first(np.asarray(first))
        dt += time.perf_counter() - t0
        self.prefill_seconds += dt
        self.observer.prefill_time(dt)
        for i, r in ended:
            self.observer.prompt_done(len(r.prompt_ids))
            if r.abort_reason is None and self._emit(r, [int(first[i])], lps, i):
                self._release(r.slot)

    def _step(self) -> None:
        """Dispatch the next step, collect the one in flight, or both (pipelined; see the module docstring); read
        a pending prefill's first tokens on every path, after the dispatch where there is one."""
        decoding, _, active = self._slot_lists()
        if self._inflight is None:
            if decoding:
                self._inflight = self._dispatch(decoding, active)
            self._read_firsts()
            return
        nxt = self._dispatch(decoding, active) if self._may_dispatch_ahead(decoding) else None
        if nxt is not None:
            self.steps_ahead += 1
            self.observer.dispatched_ahead()
        self._read_firsts()              # a prompt's first token goes out before the tokens of its first step
        flight, self._inflight = self._inflight, nxt
        self._collect(*flight)

    def _may_dispatch_ahead(self, decoding: list[EngineRequest]) -> bool:
        """Whether the next step may go out before the one in flight is read: some request likely needs it (it
        stays short of max_tokens after the step in flight commits as many tokens as its recent steps did: a step
        whose every row may have finished in flight is likely wasted), and every row stays inside its slot's context even after the step in flight
        committed its most tokens. A row that finishes in flight costs only its own row of the step ahead, whose
        outputs are discarded (its slot is re-admitted, and reset, only after that step)."""
        if not decoding:
            return False
        reach = self.backend.depth + 1       # most tokens the step in flight gives a request
        limit = self.backend.max_context
        return (all(len(r.prompt_ids) + r.generated + reach < limit for r in decoding)
                and any(r.generated + _recent_commit(r) < r.max_tokens for r in decoding))

    def _dispatch(self, decoding: list[EngineRequest], active: np.ndarray):
        be = self.backend
        self.steps[active] += 1
        if self._sampling is None:
            self._sampling = be.sampling(self.temperature, self.top_p, self.top_k, self.seed)
        stochastic = bool((self.temperature[active] > 0).any())
        pen = {}
        if any(r.penalized for r in decoding):    # the unpenalized programs otherwise (no extra inputs)
            if self._penalty is None:
                self._penalty = be.penalty(self.presence, self.frequency, self.repetition)
            pen = {"penalty": self._penalty}
        t0 = time.perf_counter()
        handle = be.dispatch(active, self._sampling, self.steps, stochastic, **pen)
        dispatched = time.perf_counter() - t0
        self.observer.engine_call("decode")
        return handle, list(self.slots), dispatched

    def _collect(self, handle, owners: list[EngineRequest | None], dispatched: float) -> None:
        t0 = time.perf_counter()
        res: StepResult = self.backend.collect(handle)
        now = time.perf_counter()
        self.observer.decode_host_time(dispatched, now - t0)
        self.steps_collected += 1
        self.first_collect_at = self.first_collect_at or now
        self.last_collect_at = now
        counts = res.count.tolist()          # Python ints once, not a numpy scalar per read
        live = [(b, r) for b, r in enumerate(owners)
                if r is not None and counts[b] > 0 and self.slots[b] is r and not r.finished]
        if not live:
            return
        tokens = res.tokens.tolist()
        accepted = None if res.accepted is None else res.accepted.tolist()
        if accepted is not None:
            self.observer.spec_round(len(live), res.drafted, np.asarray([accepted[b] for b, _ in live]),
                                     self.backend.depth)
        for b, r in live:
            n = counts[b]
            r.committed.append(n)
            if accepted is not None:
                r.accepted.append(accepted[b])
            if r.abort_reason is not None:
                continue   # freed at the next iteration
            if self._emit(r, tokens[b][:n], res.logprobs, b):
                self._release(b)


def _recent_commit(r: EngineRequest) -> float:
    """Tokens a step committed to r lately (its last 4 steps; 1 before its first): what the step in flight likely
    gives it."""
    recent = r.committed[-4:]
    return sum(recent) / len(recent) if recent else 1.0


def run_batch(backend: Backend, prompts: Sequence[Sequence[int]], params: Sequence,
              on_tokens: Callable[[int, list[int]], None] | None = None
              ) -> tuple[list[EngineRequest], list[list[int]], Scheduler]:
    """The synchronous driver: submit `prompts` (with their `SamplingParams`) to a fresh loop over `backend`, run it
    to completion on this thread. Returns (requests, generated tokens per request, the loop — its totals).
    `on_tokens(request_index, new_ids)` streams tokens as steps commit them."""
    sched = Scheduler(backend)
    outs: list[list[int]] = [[] for _ in prompts]
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        def sink(toks: list[int], reason: str | None, logprobs, i: int = i) -> None:
            if toks:
                outs[i].extend(toks)
                if on_tokens is not None:
                    on_tokens(i, list(toks))
        req = EngineRequest(prompt_ids=list(map(int, prompt)), max_tokens=p.max_tokens, sink=sink,
                            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                            stop_token_ids=frozenset(int(t) for t in p.stop_token_ids),
                            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                            repetition_penalty=p.repetition_penalty)
        sched.submit(req)
        reqs.append(req)
    sched.run_until_idle()      # on this thread: an error propagates as it is
    return reqs, outs, sched
