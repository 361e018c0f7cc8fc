"""The server's Prometheus metrics (prometheus_client), with vLLM's names where the meaning is vLLM's.

vLLM names (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total`, ...) carry vLLM's meaning, so that its dashboards and load
tools read them. What vLLM has no metric for, or measures differently, is under `hyspec:` — among them
`hyspec:slot_usage_perc`: vLLM's `kv_cache_usage_perc` counts paged KV blocks, while a slot here holds a whole
context's cache whatever its length. Every sample carries `model_name`. prometheus_client is thread-safe: the
request loop's thread observes, the HTTP thread renders.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hyspec_jax.runtime.scheduler import LoopObserver

# vLLM's buckets for the latency histograms (TTFT, ITL, e2e, queue time)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

disable_created_metrics()   # no `_created` series: vLLM's exposition has none either


class StepHistogram:
    """A histogram observed a whole device step's values at once (`observe_many`), exposed with the samples of
    prometheus_client's Histogram (a collector of its registry). That Histogram takes a lock and walks its
    buckets in Python per value: on the request loop's thread, once per request per step, competing with the
    event loop for the GIL."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str,
                 registry: CollectorRegistry):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = [float(b) for b in buckets] + [math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        with self.lock:
            for v in values:
                counts[bisect.bisect_left(bounds, v)] += 1      # the first bucket with v <= le
            self.sum += sum(values)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def collect(self):
        with self.lock:
            counts, total = list(self.counts), self.sum
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        fam.add_metric([self.model_name], [(floatToGoString(b), c) for b, c in
                                           zip(self.bounds, itertools.accumulate(counts))], total)
        yield fam


class ServerMetrics(LoopObserver):
    """The server's metric set in its own registry; the request loop reports to it (`LoopObserver`)."""

    def __init__(self, model_name: str, spec_depth: int = 0):
        r = self.registry = CollectorRegistry(auto_describe=True)
        lab = ("model_name",)

        def one(kind, name, doc, *extra, **kw):
            m = kind(name, doc, lab + extra, registry=r, **kw)
            return m if extra else m.labels(model_name=model_name)

        self._name = model_name
        self.running = one(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.slot_usage = one(Gauge, "hyspec:slot_usage_perc", "Fraction of batch slots in use (each slot holds "
                              "one request's KV cache and recurrent state for the whole context).")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = one(Counter, "vllm:request_success", "Count of successfully processed requests.",
                            "finished_reason")
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        buckets=TTFT_BUCKETS)
        # observed per request per step: by the step (`step_done`), the generation counter too
        self.itl = StepHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                 ITL_BUCKETS, model_name, r)
        self._step_itl: list[float] = []
        self._step_tokens = 0
        self.e2e = one(Histogram, "vllm:e2e_request_latency_seconds",
                       "Histogram of e2e request latency in seconds.", buckets=REQUEST_BUCKETS)
        self.queue_time = one(Histogram, "vllm:request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_BUCKETS)
        self.num_drafts = one(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = one(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = one(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._per_pos = one(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Accepted tokens per draft position.", "position")
        self.per_pos = [self._per_pos.labels(model_name=model_name, position=str(k)) for k in range(spec_depth)]
        self._rounds = one(Counter, "hyspec:spec_rounds", "Speculative rounds by the nodes verified per request "
                           "(the width chosen each round; 1: a plain decoding step).", "width")
        self._rounds_of: dict[int, object] = {}
        self.compilations_after_startup = one(
            Counter, "hyspec:compilations_after_startup",
            "XLA programs compiled after start-up (each is a recompile while serving: a bug).")
        self.compilations_startup = one(Gauge, "hyspec:compilations_at_startup",
                                        "XLA programs compiled during start-up (warm-up of every bucket).")
        self._steps = one(Counter, "hyspec:engine_steps", "Jitted engine calls by kind.", "kind")
        self.engine_steps = {k: self._steps.labels(model_name=model_name, kind=k) for k in ("prefill", "decode")}
        self.steps_ahead = one(Counter, "hyspec:engine_steps_ahead",
                               "Decoding steps dispatched before the step in flight was read (pipelined).")
        self.prefill_seconds = one(Counter, "hyspec:engine_prefill_seconds",
                                   "Time the request loop spent on prefill calls (their dispatch and the wait for "
                                   "their first tokens), seconds.")
        self.dispatch_seconds = one(Counter, "hyspec:engine_decode_dispatch_seconds",
                                    "Time the request loop spent dispatching decoding steps (argument handling and "
                                    "kernel launches), seconds.")
        self.collect_seconds = one(Counter, "hyspec:engine_decode_collect_seconds",
                                   "Time the request loop spent collecting decoding steps (waiting for the device, "
                                   "then reading back), seconds: near 0 when the host sets the step's period.")
        self._errors = one(Counter, "hyspec:request_errors", "Requests answered with an error, by status.", "status")
        self.aborted = one(Counter, "hyspec:requests_aborted",
                           "Requests that ended early (client disconnect, stop string) and freed their slot.")
        self.success = {k: self._success.labels(model_name=model_name, finished_reason=k)
                        for k in ("stop", "length", "abort")}

    def request_error(self, status: int) -> None:
        self._errors.labels(model_name=self._name, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- LoopObserver ----------------------------------------------------------------------------------
    def occupancy(self, running: int, waiting: int, slots: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.slot_usage.set(running / slots)

    def admitted(self, queue_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)

    def engine_call(self, kind: str) -> None:
        self.engine_steps[kind].inc()

    def dispatched_ahead(self) -> None:
        self.steps_ahead.inc()

    def prefill_time(self, seconds: float) -> None:
        self.prefill_seconds.inc(seconds)

    def decode_host_time(self, dispatch: float, collect: float) -> None:
        self.dispatch_seconds.inc(dispatch)
        self.collect_seconds.inc(collect)

    def prompt_done(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self._step_itl.append(itl)
        self._step_tokens += n

    def step_done(self) -> None:
        if self._step_itl:
            self.itl.observe_many(self._step_itl)
            self._step_itl = []
        if self._step_tokens:
            self.generation_tokens.inc(self._step_tokens)
            self._step_tokens = 0

    def finished(self, reason: str, e2e_seconds: float, aborted: bool) -> None:
        self.e2e.observe(e2e_seconds)
        if reason in self.success:
            self.success[reason].inc()
        if aborted:
            self.aborted.inc()

    def spec_round(self, active: int, drafted: int, accepted: np.ndarray, depth: int) -> None:
        width = drafted + 1
        if width not in self._rounds_of:
            self._rounds_of[width] = self._rounds.labels(model_name=self._name, width=str(width))
        self._rounds_of[width].inc()
        self.num_drafts.inc(active)
        self.draft_tokens.inc(active * drafted)
        self.accepted_tokens.inc(int(accepted.sum()))
        for k in range(depth):
            c = int((accepted > k).sum())
            if c:
                self.per_pos[k].inc(c)
