"""GET /metrics: the engine replicas' stats snapshots as Prometheus families named like vLLM's.

Counters and histograms are summed across replicas, request gauges summed, KV-cache usage
averaged, the weight version the highest (the cluster's), the batch-invariant flag the lowest
(1 only when every replica runs the mode). Nothing is kept between scrapes: each
one asks the backend for fresh snapshots, and each extra source (`build_app(metrics_sources=)`)
for its text, which is appended as it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from raylane.session_server.context import backend_of
from raylane.session_server.openapi import ok

PREFIX = "raylane:"
SOURCE_TIMEOUT_S = 2.0  # a scrape waits this long for an extra source, then goes without it

# More families for /metrics: an async call returning Prometheus text (e.g. an actor's).
MetricsSource = Callable[[], Awaitable[str]]
log = logging.getLogger(__name__)
GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "weight_version": "Version of the weights the engines serve (the newest, across replicas).",
    "kv_cache_bytes_per_token": "KV-cache bytes one token takes in a replica (all its ranks).",
    "batch_invariant": "1 when every replica runs the batch-invariant mode (outputs independent "
    "of batching), else 0.",
}
AVERAGED = {"kv_cache_usage_perc", "kv_cache_bytes_per_token"}
HIGHEST = {"weight_version"}
LOWEST = {"batch_invariant"}  # one replica outside the mode breaks the promise
COUNTERS = {
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "num_preemptions": "Cumulative number of preemptions from the engine.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "steps_planned_ahead": "Engine steps planned while the step before ran (async scheduling).",
    "grammar_skips": "Constrained rows that sat out a step: their grammar mask was not ready.",
    "graph_replays": "Decode and verify steps replayed from a CUDA graph (an eager replay on CPU).",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent waiting in the queue in seconds.",
}

SPEC_COUNTERS = {
    "spec_decode_num_drafts": "Number of spec decoding drafts (sequences that carried drafts).",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}

FINISH_REASONS = frozenset({"stop", "length", "abort", "stale", "error"})

router = APIRouter()


class EngineStatsCollector(Collector):
    """Prometheus families over a list of `EngineStats.snapshot()` dicts, one per replica."""

    def __init__(self, model_name: str, snapshots: list[dict]):
        self.model_name = model_name
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._counters()
        yield from self._spec_counters()
        yield self._finished()
        for name, doc in HISTOGRAMS.items():
            yield self._histogram(name, doc)

    def _gauges(self) -> Iterator[Metric]:
        for name, doc in GAUGES.items():
            values = [s["gauges"].get(name, 0) for s in self.snapshots]
            value = _combine(name, values)
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def _counters(self) -> Iterator[Metric]:
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], sum(s["counters"][name] for s in self.snapshots))
            yield family

    def _spec_counters(self) -> Iterator[Metric]:
        """Speculative decoding, as vLLM names it (zeros where no replica speculates)."""
        specs = [s.get("spec_decode", {}) for s in self.snapshots]
        for name, doc in SPEC_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], sum(s.get(name, 0) for s in specs))
            yield family
        per_pos: Counter[int] = Counter()
        for s in specs:
            for pos, count in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
                per_pos[pos] += count
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        for pos in sorted(per_pos):
            family.add_metric([self.model_name, str(pos)], per_pos[pos])
        yield family

    def _finished(self) -> Metric:
        total: Counter[str] = Counter()
        for s in self.snapshots:
            total.update(s["finished"])
        family = CounterMetricFamily(
            PREFIX + "request_success",
            "Count of processed requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted(FINISH_REASONS | set(total)):  # zeros too, so rates start at 0
            family.add_metric([self.model_name, reason], total[reason])
        return family

    def _histogram(self, name: str, doc: str) -> Metric:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        parts = [s["histograms"][name] for s in self.snapshots]
        if parts:
            bounds = parts[0]["buckets"]
            # replicas run the same code, so their bucket bounds agree
            counts = [sum(col) for col in zip(*(p["counts"] for p in parts))]
            family.add_metric(
                [self.model_name], _cumulative(bounds, counts), sum(p["sum"] for p in parts)
            )
        return family


def _combine(name: str, values: list[float]) -> float:
    if name in AVERAGED:
        return sum(values) / max(len(values), 1)
    if name in HIGHEST:
        return max(values, default=0)
    if name in LOWEST:
        return min(values, default=0)
    return sum(values)


def _cumulative(bounds: list[float], counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one +Inf) -> Prometheus's cumulative `le` buckets."""
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip([*map(float, bounds), float("inf")], counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out


def render(model_name: str, snapshots: list[dict]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(model_name, snapshots))
    return generate_latest(registry)


@router.get(
    "/metrics",
    response_class=Response,
    responses=ok(
        content={
            "text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}
        }
    ),
)
async def metrics(request: Request) -> Response:
    backend = backend_of(request)
    body = render(backend.info.name, await backend.stats())
    extra = await asyncio.gather(*(_scrape(s) for s in request.app.state.metrics_sources))
    return Response(body + "".join(extra).encode(), media_type=CONTENT_TYPE_LATEST)


async def _scrape(source: MetricsSource) -> str:
    """The source's text, or "" when it fails or is slow: one dead source must not take the
    engines' metrics down with it."""
    try:
        text = await asyncio.wait_for(source(), SOURCE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure of the source only drops its families
        log.warning("/metrics: left out %r: %s: %s", source, type(exc).__name__, exc)
        return ""
    return text if not text or text.endswith("\n") else text + "\n"
