"""Prometheus metrics in the text exposition format (no dependency), with vLLM's metric names.

Names follow vLLM (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total`, …) so that existing dashboards and load tools read them;
metrics vLLM has no equivalent for are under `hyspec:` (compilations after start-up, engine calls, errors).
Every sample carries `model_name`. Thread-safe: the scheduler thread observes, the HTTP thread renders.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable

import numpy as np

from hyspec_jax.runtime.scheduler import LoopObserver

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{_escape(str(v))}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer():
        return str(int(x)) if abs(x) < 1e15 else repr(float(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, doc: str, labelnames: tuple[str, ...] = ()):
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._lock = registry.lock
        self._base = registry.base_labels
        registry.metrics.append(self)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple(str(labels[k]) for k in self.labelnames)

    def _pairs(self, key: tuple[str, ...]) -> list[tuple[str, str]]:
        return list(self._base) + list(zip(self.labelnames, key))

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, registry, name, doc, labelnames=()):
        if not name.endswith("_total"):
            raise ValueError("counter names end with _total")
        super().__init__(registry, name, doc, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        # The text format names a counter family without `_total` and its sample with it.
        family = self.name[: -len("_total")]
        out = [f"# HELP {family} {self.doc}", f"# TYPE {family} counter"]
        for key, v in sorted(self._values.items()):
            out.append(f"{self.name}{_labels(self._pairs(key))} {_num(v)}")
        return out


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, registry, name, doc, labelnames=()):
        super().__init__(registry, name, doc, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def set(self, value: float, **labels) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def get(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        out = self.header()
        for key, v in sorted(self._values.items()):
            out.append(f"{self.name}{_labels(self._pairs(key))} {_num(v)}")
        return out


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, doc, buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(registry, name, doc)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def render(self) -> list[str]:
        out = self.header()
        cum = 0
        for b, c in zip(self.buckets, self._counts):
            cum += c
            out.append(f"{self.name}_bucket{_labels(self._pairs(()) + [('le', _num(b))])} {cum}")
        out.append(f"{self.name}_sum{_labels(self._pairs(()))} {_num(self._sum)}")
        out.append(f"{self.name}_count{_labels(self._pairs(()))} {self._count}")
        return out


class Registry:
    def __init__(self, base_labels: dict[str, str] | None = None):
        self.lock = threading.RLock()
        self.base_labels = tuple((base_labels or {}).items())
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        with self.lock:
            lines: list[str] = []
            for m in self.metrics:
                lines.extend(m.render())
        return "\n".join(lines) + "\n"


class ServerMetrics(LoopObserver):
    """The server's metric set; the request loop reports to it (`LoopObserver`)."""

    def __init__(self, model_name: str, spec_depth: int = 0):
        r = self.registry = Registry({"model_name": model_name})
        self.running = Gauge(r, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = Gauge(r, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.slot_usage = Gauge(r, "vllm:kv_cache_usage_perc",
                                "Fraction of batch slots (each with its own KV cache and recurrent state) in use.")
        self.prompt_tokens = Counter(r, "vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = Counter(r, "vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.request_success = Counter(r, "vllm:request_success_total", "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.ttft = Histogram(r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.itl = Histogram(r, "vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds (one observation per engine step that "
                             "gave the request tokens).")
        self.e2e = Histogram(r, "vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.")
        self.queue_time = Histogram(r, "vllm:request_queue_time_seconds",
                                    "Histogram of time spent waiting for a batch slot in seconds.")
        self.num_drafts = Counter(r, "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.")
        self.draft_tokens = Counter(r, "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.")
        self.accepted_tokens = Counter(r, "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.")
        self.accepted_per_pos = Counter(r, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                        "Accepted tokens per draft position.", ("position",))
        for k in range(spec_depth):
            self.accepted_per_pos.inc(0, position=str(k))
        self.compilations_after_startup = Counter(
            r, "hyspec:compilations_after_startup_total",
            "XLA programs compiled after start-up (each is a recompile while serving: a bug).")
        self.compilations_startup = Gauge(r, "hyspec:compilations_at_startup",
                                          "XLA programs compiled during start-up (warm-up of every bucket).")
        self.engine_steps = Counter(r, "hyspec:engine_steps_total", "Jitted engine calls by kind.", ("kind",))
        for kind in ("prefill", "decode"):
            self.engine_steps.inc(0, kind=kind)
        self.request_errors = Counter(r, "hyspec:request_errors_total", "Requests answered with an error, by status.",
                                      ("status",))
        self.aborted = Counter(r, "hyspec:requests_aborted_total",
                               "Requests that ended early (client disconnect, stop string) and freed their slot.")

    def render(self) -> str:
        return self.registry.render()

    # --- LoopObserver ----------------------------------------------------------------------------------
    def occupancy(self, running: int, waiting: int, slots: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.slot_usage.set(running / slots)

    def admitted(self, queue_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)

    def engine_call(self, kind: str) -> None:
        self.engine_steps.inc(kind=kind)

    def prompt_done(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)
        self.generation_tokens.inc(n)

    def finished(self, reason: str, e2e_seconds: float, aborted: bool) -> None:
        self.e2e.observe(e2e_seconds)
        if reason in ("stop", "length", "abort"):
            self.request_success.inc(finished_reason=reason)
        if aborted:
            self.aborted.inc()

    def spec_round(self, active: int, drafted: int, accepted: np.ndarray, depth: int) -> None:
        self.num_drafts.inc(active)
        self.draft_tokens.inc(active * drafted)
        self.accepted_tokens.inc(int(accepted.sum()))
        for k in range(depth):
            c = int((accepted > k).sum())
            if c:
                self.accepted_per_pos.inc(c, position=str(k))


def parse_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A small parser of the text format (samples by name; used by tests and the load benchmark)."""
    import re
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = sample.match(line)
        if not m:
            raise ValueError(f"bad metrics line: {line!r}")
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in label.findall(m.group(3) or "")}
        out.setdefault(m.group(1), []).append((labels, float(m.group(4))))
    return out
