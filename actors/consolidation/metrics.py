"""Prometheus metrics of the consolidation actor (`raylane:consolidation_*`)."""

from __future__ import annotations

import functools

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .perf import BatchPerf

BATCH_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ConsolidationMetrics:
    """Counters and the batch-latency histogram, registered in `registry`.

    Tests pass their own `CollectorRegistry` so each can count from zero; processes use
    `default_metrics()`, since registering the same names twice in one registry is an error.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.memories = Counter(
            "raylane:consolidation_memories", "Memories processed", ["outcome"], registry=registry
        )
        self.observations = Counter(
            "raylane:consolidation_observations",
            "Observations written",
            ["action"],
            registry=registry,
        )
        self.llm_calls = Counter(
            "raylane:consolidation_llm_calls", "LLM calls made", ["result"], registry=registry
        )
        self.runs = Counter(
            "raylane:consolidation_runs",
            "Consolidation runs finished",
            ["status"],
            registry=registry,
        )
        self.batch_latency = Histogram(
            "raylane:consolidation_batch_latency_seconds",
            "Wall time of one LLM batch, commit included",
            buckets=BATCH_LATENCY_BUCKETS,
            registry=registry,
        )
        self.passes = Counter(
            "raylane:consolidation_passes",
            "Scheduled passes over the banks "
            "finished (failed: a run failed or the pass could not start)",
            ["result"],
            registry=registry,
        )
        for result in ("completed", "failed"):  # both series from the start: rates begin at 0
            self.passes.labels(result)
        self.last_pass = Gauge(
            "raylane:consolidation_last_pass_duration_seconds",
            "Wall time of the last finished pass",
            registry=registry,
        )

    def record_batch(self, perf: BatchPerf) -> None:
        for counter, value in zip(self._batch_children, self._batch_values(perf)):
            counter.inc(value)
        self.batch_latency.observe(perf.wall_seconds)

    @functools.cached_property
    def _batch_children(self) -> tuple:
        # Resolved once: `labels()` takes a lock and a dict lookup on every call.
        return (
            self.memories.labels("consolidated"),
            self.memories.labels("skipped"),
            self.memories.labels("failed"),
            self.observations.labels("create"),
            self.observations.labels("update"),
            self.llm_calls.labels("ok"),
            self.llm_calls.labels("failed"),
        )

    @staticmethod
    def _batch_values(perf: BatchPerf) -> tuple[int, ...]:
        return (
            perf.consolidated - perf.skipped,
            perf.skipped,
            perf.failed,
            perf.created,
            perf.updated,
            perf.llm_calls - perf.failed_calls,
            perf.failed_calls,
        )

    def record_run(self, status: str) -> None:
        self.runs.labels(status).inc()

    def record_pass(self, ok: bool, seconds: float) -> None:
        self.passes.labels("completed" if ok else "failed").inc()
        self.last_pass.set(seconds)


@functools.cache
def default_metrics() -> ConsolidationMetrics:
    """The process-wide metrics in the global registry, created once."""
    return ConsolidationMetrics()
