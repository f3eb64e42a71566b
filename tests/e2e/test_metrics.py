"""/metrics parses as Prometheus text, moves with traffic, and sums replicas' snapshots."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from session_server.metrics import render

FAMILIES = {
    "raylane:num_requests_running": "gauge", "raylane:num_requests_waiting": "gauge",
    "raylane:kv_cache_usage_perc": "gauge", "raylane:weight_version": "gauge",
    "raylane:prompt_tokens": "counter",
    "raylane:generation_tokens": "counter", "raylane:num_preemptions": "counter",
    "raylane:prefix_cache_queries": "counter", "raylane:prefix_cache_hits": "counter",
    "raylane:request_success": "counter",
    "raylane:time_to_first_token_seconds": "histogram",
    "raylane:inter_token_latency_seconds": "histogram",
    "raylane:e2e_request_latency_seconds": "histogram",
    "raylane:request_queue_time_seconds": "histogram",
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels) -> float:
    return scrape[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def test_metrics_families_and_types(http):
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    assert families == FAMILIES


def test_counters_move_with_requests(http, engine):
    before = samples(http.get("/metrics").text)
    body = {"prompt": "Hello, world!", "max_tokens": 5, "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    after = samples(http.get("/metrics").text)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("raylane:generation_tokens_total") == usage["completion_tokens"] == 5
    assert moved("raylane:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("raylane:request_success_total", finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert moved(f"raylane:{hist}_count") == 1
        assert moved(f"raylane:{hist}_bucket", le="+Inf") == 1
    assert moved("raylane:inter_token_latency_seconds_count") == 4
    assert value(after, "raylane:num_requests_running") == 0


def test_replica_snapshots_are_aggregated(engine):
    one = engine.stats_snapshot()
    busy = {**one, "gauges": {**one["gauges"], "kv_cache_usage_perc": 0.5,
                               "num_requests_running": 3, "weight_version": 7}}
    merged = samples(render("tiny", [one, busy]).decode())
    counters = one["counters"]
    assert value(merged, "raylane:prompt_tokens_total") == 2 * counters["prompt_tokens"]
    assert value(merged, "raylane:prefix_cache_hits_total") == 2 * counters["prefix_cache_hits"]
    assert value(merged, "raylane:num_requests_running") == 3 + one["gauges"][
        "num_requests_running"]
    assert value(merged, "raylane:kv_cache_usage_perc") == pytest.approx(
        (0.5 + one["gauges"]["kv_cache_usage_perc"]) / 2)
    assert value(merged, "raylane:weight_version") == 7  # the newest, not a sum
    ttft = one["histograms"]["time_to_first_token_seconds"]
    assert value(merged, "raylane:time_to_first_token_seconds_count") == 2 * sum(ttft["counts"])
    assert value(merged, "raylane:time_to_first_token_seconds_sum") == pytest.approx(
        2 * ttft["sum"])
    for reason, count in one["finished"].items():
        assert value(merged, "raylane:request_success_total", finished_reason=reason) == 2 * count
    empty = samples(render("tiny", []).decode())
    assert value(empty, "raylane:generation_tokens_total") == 0
