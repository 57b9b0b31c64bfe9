"""Serving metrics: what a Triton model exports through `pb_utils.MetricFamily` (or any factory).

`ServingMetrics` is given `make(kind, name, description, buckets)` returning an object with
`observe` (histograms), `increment` (counters) or `set` (gauges); the Python-backend model passes
one over `pb_utils.MetricFamily`, tests pass a recording one. Triton serves them on its metrics
port next to its own, labelled with the model name and version.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from llmc.runtime.engine.core import CacheState

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
    "llmc_prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache (paged KV cache)",
    "llmc_prefix_cache_hits_total": "Prompt tokens whose KV the prefix cache already held (paged KV cache)",
    "llmc_preemptions_total": "Running requests whose KV blocks were taken back, to be recomputed (paged KV cache)",
    # speculative decoding, TensorRT-LLM's total_draft_tokens and total_accepted_draft_tokens
    "llmc_spec_decode_draft_tokens_total": "Proposed (draft) tokens verified by speculative decoding",
    "llmc_spec_decode_accepted_tokens_total": "Proposed (draft) tokens the target model accepted",
    "llmc_engine_restarts_total": "Engines loaded again after their runner broke (a tensor-parallel rank died)",
}
GAUGES = {
    "llmc_requests_running": "Requests holding KV cache (a slot, or blocks)",
    "llmc_requests_waiting": "Requests queued for the running batch",
    "llmc_kv_cache_usage_ratio": "Fraction of the KV cache in use (slots, or blocks)",
    # TensorRT-LLM's acceptance_rate; set once a proposal has been verified
    "llmc_spec_decode_acceptance_rate": "Accepted / proposed tokens of speculative decoding since start",
    "llmc_tensor_parallel_ranks": "Processes the model is split over (parallel.tensor; 1: not split)",
}
# a gauge per state, one family: llmc_kv_cache_blocks{state="used|free|cached"}
BLOCK_STATES = ("used", "free", "cached")
BLOCKS = ("llmc_kv_cache_blocks", "KV cache blocks (paged KV cache) by state: held by requests, never used or "
                                  "freed, or kept for prefix reuse")
TOTALS = {"llmc_prefix_cache_queries_total": "prefix_queries", "llmc_prefix_cache_hits_total": "prefix_hits",
          "llmc_preemptions_total": "preemptions", "llmc_spec_decode_draft_tokens_total": "draft_tokens",
          "llmc_spec_decode_accepted_tokens_total": "accepted_draft_tokens"}

Factory = Callable[..., object]  # (kind, name, description, buckets, extra labels=None) -> metric


class ServingMetrics:
    def __init__(self, make: Factory):
        self.m = {name: make("histogram", name, doc, LATENCY_BUCKETS) for name, doc in HISTOGRAMS.items()}
        self.m.update({name: make("counter", name, doc, None) for name, doc in COUNTERS.items()})
        self.m.update({name: make("gauge", name, doc, None) for name, doc in GAUGES.items()})
        self.blocks = {state: make("gauge", BLOCKS[0], BLOCKS[1], None, {"state": state}) for state in BLOCK_STATES}
        self._totals = dict.fromkeys(TOTALS.values(), 0)  # the engine's totals last counted

    def first_token(self, seconds: float) -> None:
        self.m["llmc_time_to_first_token_seconds"].observe(seconds)

    def tokens(self, count: int, seconds_each: float | None) -> None:
        """`count` tokens generated for one request; `seconds_each` since its previous token (several
        tokens at once, from speculative decoding, share the wait since the previous response)."""
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

    def ranks(self, count: int) -> None:
        self.m["llmc_tensor_parallel_ranks"].set(count)

    def restarted(self) -> None:
        """A new engine replaced a broken one: its totals start from zero again."""
        self.m["llmc_engine_restarts_total"].increment(1)
        self._totals = dict.fromkeys(TOTALS.values(), 0)

    def load(self, state: "CacheState") -> None:
        """The engine's cache and queues after a step (runtime/engine/core.py CacheState)."""
        self.m["llmc_requests_running"].set(state.running)
        self.m["llmc_requests_waiting"].set(state.waiting)
        self.m["llmc_kv_cache_usage_ratio"].set(state.usage)
        for name, value in (state.blocks or {}).items():
            self.blocks[name].set(value)
        for name, field in TOTALS.items():  # counters only go up: count what the engine added since
            value = getattr(state, field)
            if value > self._totals[field]:
                self.m[name].increment(value - self._totals[field])
                self._totals[field] = value
        if state.draft_tokens:
            self.m["llmc_spec_decode_acceptance_rate"].set(state.accepted_draft_tokens / state.draft_tokens)


class _Null:
    def observe(self, value: float) -> None: ...
    def increment(self, value: float) -> None: ...
    def set(self, value: float) -> None: ...


def null_metrics() -> ServingMetrics:
    return ServingMetrics(lambda *args: _Null())


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

    by_name = {}  # one family per name, however many labelled metrics it has

    def make(kind: str, name: str, doc: str, buckets, extra: dict[str, str] | None = None):
        family = by_name.get(name)
        if family is None:
            family = by_name[name] = pb_utils.MetricFamily(name=name, description=doc, kind=kinds[kind])
            families.append(family)
        tags = {**labels, **(extra or {})}
        metric = family.Metric(labels=tags, buckets=buckets) if buckets else family.Metric(labels=tags)
        return _Serialized(metric, lock)

    metrics = ServingMetrics(make)
    metrics.families = families
    return metrics
