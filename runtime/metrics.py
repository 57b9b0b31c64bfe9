"""Serving metrics: what a Triton model exports through `pb_utils.MetricFamily` (or any factory).

`ServingMetrics` is given `make(kind, name, description, buckets)` returning an object with
`observe` (histograms), `increment` (counters) or `set` (gauges); the Python-backend model passes
one over `pb_utils.MetricFamily`, tests pass a recording one. Triton serves them on its metrics
port next to its own, labelled with the model name and version.
"""

from __future__ import annotations

import threading
from typing import Callable

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]

HISTOGRAMS = {
    "llmc_time_to_first_token_seconds": "Time from a request's arrival to its first generated token",
    "llmc_inter_token_latency_seconds": "Time between consecutive generated tokens of a request",
    "llmc_request_latency_seconds": "Time from a request's arrival to its last response",
}
COUNTERS = {
    "llmc_prompt_tokens_total": "Prompt tokens of admitted requests",
    "llmc_generation_tokens_total": "Tokens generated",
    "llmc_request_success_total": "Requests that finished (stop or length)",
    "llmc_request_failure_total": "Requests answered with an error or cancelled",
}
GAUGES = {
    "llmc_requests_running": "Requests holding a KV slot",
    "llmc_requests_waiting": "Requests queued for a KV slot",
    "llmc_kv_cache_usage_ratio": "Fraction of the KV cache's slots in use",
}

Factory = Callable[[str, str, str, "list[float] | None"], object]


class ServingMetrics:
    def __init__(self, make: Factory):
        self.m = {name: make("histogram", name, doc, LATENCY_BUCKETS) for name, doc in HISTOGRAMS.items()}
        self.m.update({name: make("counter", name, doc, None) for name, doc in COUNTERS.items()})
        self.m.update({name: make("gauge", name, doc, None) for name, doc in GAUGES.items()})

    def first_token(self, seconds: float) -> None:
        self.m["llmc_time_to_first_token_seconds"].observe(seconds)

    def tokens(self, count: int, seconds_each: float | None) -> None:
        """`count` tokens generated for one request; `seconds_each` since its previous token."""
        self.m["llmc_generation_tokens_total"].increment(count)
        if seconds_each is not None:
            for _ in range(count):
                self.m["llmc_inter_token_latency_seconds"].observe(seconds_each)

    def admitted(self, prompt_tokens: int) -> None:
        self.m["llmc_prompt_tokens_total"].increment(prompt_tokens)

    def finished(self, seconds: float, success: bool) -> None:
        self.m["llmc_request_latency_seconds"].observe(seconds)
        self.m["llmc_request_success_total" if success else "llmc_request_failure_total"].increment(1)

    def failed(self) -> None:
        self.m["llmc_request_failure_total"].increment(1)

    def load(self, running: int, waiting: int, slots: int) -> None:
        self.m["llmc_requests_running"].set(running)
        self.m["llmc_requests_waiting"].set(waiting)
        self.m["llmc_kv_cache_usage_ratio"].set(running / slots)


class _Null:
    def observe(self, value: float) -> None: ...
    def increment(self, value: float) -> None: ...
    def set(self, value: float) -> None: ...


def null_metrics() -> ServingMetrics:
    return ServingMetrics(lambda kind, name, doc, buckets: _Null())


class _Serialized:
    """A metric whose updates hold one lock shared by all of a model's metrics. The serving loop's
    thread and Triton's execute thread both update them (a refused request counts as a failure on
    the execute thread, a cancelled one on the loop's), and the Python backend's metric calls are
    not thread-safe: unserialized, a soak of 64 streams mixing cancellations with malformed requests
    killed Triton 2.51 in 24 of 25 40-second runs (SIGSEGV in libtriton_python.so, or SIGABRT on a
    boost::interprocess::lock_exception from the stub's shared-memory mutex); serialized, 0 of 6,
    and 0 of 10 runs of the soak test's settings (1 in 8 failed before)."""

    def __init__(self, metric, lock: threading.Lock):
        self.metric, self.lock = metric, lock

    def observe(self, value: float) -> None:
        with self.lock:
            self.metric.observe(value)

    def increment(self, value: float) -> None:
        with self.lock:
            self.metric.increment(value)

    def set(self, value: float) -> None:
        with self.lock:
            self.metric.set(value)


def triton_metrics(pb_utils, labels: dict[str, str]) -> ServingMetrics:
    """Metrics registered with the Triton Python backend (call from the model's `initialize`)."""
    kinds = {"histogram": pb_utils.MetricFamily.HISTOGRAM, "counter": pb_utils.MetricFamily.COUNTER,
             "gauge": pb_utils.MetricFamily.GAUGE}
    families = []  # a family must outlive its metrics
    lock = threading.Lock()

    def make(kind: str, name: str, doc: str, buckets):
        family = pb_utils.MetricFamily(name=name, description=doc, kind=kinds[kind])
        families.append(family)
        metric = family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)
        return _Serialized(metric, lock)

    metrics = ServingMetrics(make)
    metrics.families = families
    return metrics
