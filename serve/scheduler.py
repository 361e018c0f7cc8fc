"""Continuous batching: a scheduler thread that owns the device state and admits requests between steps.

Per iteration: drop aborted requests (a disconnected client, a stop string the front end saw) and free their
slots; admit waiting requests into free slots; run one prefill call (chunks of one or more prompts, packed into
one of the static prefill shapes); then one decoding step (AR token or speculative round) for every slot that
is decoding. A long prompt therefore advances one chunk per iteration while the other slots keep decoding.
Stop token ids and max_tokens are applied here (exactly, also inside a multi-token speculative round); stop
strings are text, applied by the front end, which then aborts the request.

Requests talk to the front end through `sink(token_ids, finish_reason | None)` (called on this thread) and
`abort()` (any thread).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from hyspec_jax.serve.backend import Backend
from hyspec_jax.serve.metrics import ServerMetrics

log = logging.getLogger("hyspec.serve")

Sink = Callable[[list[int], "str | None"], None]
_ids = itertools.count()


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


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
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    # scheduler-owned
    slot: int = -1
    prefilled: int = 0
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    abort_reason: str | None = None     # set by abort(): "abort" (client left) or "stop" (stop string)

    @property
    def decoding(self) -> bool:
        return self.slot >= 0 and self.prefilled >= len(self.prompt_ids)


class Scheduler:
    def __init__(self, backend: Backend, metrics: ServerMetrics, *, max_queue: int):
        self.backend = backend
        self.metrics = metrics
        self.max_queue = max_queue
        B = backend.slots
        self.slots: list[EngineRequest | None] = [None] * B
        self.waiting: deque[EngineRequest] = deque()
        self.cv = threading.Condition()
        self.accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        # per-slot host mirrors of the device-side sampling inputs
        self.last = np.zeros(B, np.int32)
        self.steps = np.zeros(B, np.int32)
        self.temperature = np.zeros(B, np.float32)
        self.top_p = np.ones(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.seed = np.zeros(B, np.uint32)
        self._sampling = None            # device SlotSampling for the decode step (rebuilt on changes)
        self.failed: BaseException | None = None

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
            self.metrics.waiting.set(len(self.waiting))
            self.cv.notify()

    def abort(self, req: EngineRequest, reason: str = "abort") -> None:
        with self.cv:
            if not req.finished and req.abort_reason is None:
                req.abort_reason = reason
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
    def busy(self) -> bool:
        with self.cv:
            return bool(self.waiting) or any(s is not None for s in self.slots)

    # --- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    self._reap()
                    self._gauges()
                    while not self._has_work() and not self._stop and self.accepting:
                        self.cv.wait()
                    if self._stop:
                        self._abort_all("abort")
                        return
                    if not self.accepting and not self._has_work():
                        return
                    self._reap()
                    self._admit()
                    self._gauges()
                if any(r is not None and not r.decoding for r in self.slots):
                    self._prefill()
                if any(r is not None and r.decoding for r in self.slots):
                    self._step()
        except BaseException as e:  # noqa: BLE001 - fail requests, never hang them
            log.exception("scheduler failed")
            self.failed = e
            with self.cv:
                self.accepting = False
                self._abort_all("error")

    def _has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def _gauges(self) -> None:
        running = sum(s is not None for s in self.slots)
        self.metrics.running.set(running)
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.slot_usage.set(running / len(self.slots))

    def _abort_all(self, reason: str) -> None:
        for r in list(self.waiting) + [s for s in self.slots if s is not None]:
            self._finish(r, reason)
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        self._gauges()

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
                self._sampling = None

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
                self.steps[b] = 0
                self._sampling = None
                self.metrics.queue_time.observe(time.perf_counter() - r.arrival)

    def _finish(self, r: EngineRequest, reason: str, notify: bool = True) -> None:
        if r.finished:
            return
        r.finished = True
        now = time.perf_counter()
        self.metrics.e2e.observe(now - r.arrival)
        if reason in ("stop", "length", "abort"):
            self.metrics.request_success.inc(finished_reason=reason)
        if r.abort_reason is not None or reason in ("abort", "error"):
            self.metrics.aborted.inc()
        if notify:
            try:
                r.sink([], reason)
            except Exception:  # noqa: BLE001
                log.exception("sink failed")

    def _emit(self, r: EngineRequest, toks: list[int]) -> bool:
        """Give r its new tokens, cut at a stop token or max_tokens. True when r finished."""
        out, reason = [], None
        for t in toks:
            out.append(int(t))
            r.generated += 1
            if t in r.stop_token_ids:
                reason = "stop"
                break
            if r.generated >= r.max_tokens:
                reason = "length"
                break
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
            self.metrics.ttft.observe(now - r.arrival)
        else:
            self.metrics.itl.observe(now - r.last_token_at)
        r.last_token_at = now
        self.metrics.generation_tokens.inc(len(out))
        if reason is not None:
            r.finished = True
            self.metrics.e2e.observe(now - r.arrival)
            self.metrics.request_success.inc(finished_reason=reason)
        try:
            r.sink(out, reason)
        except Exception:  # noqa: BLE001
            log.exception("sink failed")
        return reason is not None

    def _release(self, b: int) -> None:
        with self.cv:
            self.slots[b] = None
            self._sampling = None
            self._gauges()

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
        first = be.prefill(slots, tokens, valid, reset, be.sampling(temp, top_p, top_k, seed))
        self.metrics.engine_steps.inc(kind="prefill")
        for i, r in enumerate(chosen):
            r.prefilled += int(valid[i].sum())
            if r.decoding:
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))
                if r.abort_reason is None:
                    tok = int(first[i])
                    self.last[r.slot] = tok
                    if self._emit(r, [tok]):
                        self._release(r.slot)

    def _step(self) -> None:
        be = self.backend
        B = be.slots
        active = np.array([r is not None and r.decoding and not r.finished for r in self.slots])
        if not active.any():
            return
        self.steps[active] += 1
        if self._sampling is None:
            self._sampling = be.sampling(self.temperature, self.top_p, self.top_k, self.seed)
        stochastic = bool((self.temperature[active] > 0).any())
        res = be.step(active, self.last, self._sampling, self.steps, stochastic)
        self.metrics.engine_steps.inc(kind="decode")
        if res.accepted is not None:
            n = int(active.sum())
            self.metrics.num_drafts.inc(n)
            self.metrics.draft_tokens.inc(n * res.drafted)
            acc = res.accepted[active]
            self.metrics.accepted_tokens.inc(int(acc.sum()))
            for k in range(be.depth):
                c = int((acc > k).sum())
                if c:
                    self.metrics.accepted_per_pos.inc(c, position=str(k))
        for b in range(B):
            r = self.slots[b]
            if r is None or not active[b]:
                continue
            n = int(res.count[b])
            toks = [int(t) for t in res.tokens[b, :n]]
            if n:
                self.last[b] = toks[-1]
            if r.abort_reason is not None:
                continue   # freed at the next iteration
            if self._emit(r, toks):
                self._release(b)
