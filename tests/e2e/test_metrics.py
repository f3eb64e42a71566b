"""/metrics parses as Prometheus text, moves with traffic, and sums replicas' snapshots."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from raylane.session_server.metrics import render

FAMILIES = {
    "raylane:num_requests_running": "gauge",
    "raylane:num_requests_waiting": "gauge",
    "raylane:kv_cache_usage_perc": "gauge",
    "raylane:weight_version": "gauge",
    "raylane:kv_cache_bytes_per_token": "gauge",
    "raylane:batch_invariant": "gauge",
    "raylane:prompt_tokens": "counter",
    "raylane:generation_tokens": "counter",
    "raylane:num_preemptions": "counter",
    "raylane:prefix_cache_queries": "counter",
    "raylane:prefix_cache_hits": "counter",
    "raylane:steps_planned_ahead": "counter",
    "raylane:grammar_skips": "counter",
    "raylane:request_success": "counter",
    "raylane:graph_replays": "counter",
    "raylane:spec_decode_num_drafts": "counter",
    "raylane:spec_decode_num_draft_tokens": "counter",
    "raylane:spec_decode_num_accepted_tokens": "counter",
    "raylane:spec_decode_num_accepted_tokens_per_pos": "counter",
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
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert moved(f"raylane:{hist}_count") == 1
        assert moved(f"raylane:{hist}_bucket", le="+Inf") == 1
    assert moved("raylane:inter_token_latency_seconds_count") == 4
    assert value(after, "raylane:num_requests_running") == 0
    assert value(after, "raylane:batch_invariant") == 0  # the server's engine is not in the mode
    kv_bytes = value(after, "raylane:kv_cache_bytes_per_token")
    assert kv_bytes == engine.runner_info.kv_bytes_per_token > 0
    # async scheduling (the default) planned the steps after the first one ahead: the 4
    # decodes, and possibly one more before the 5th token's result showed it was the last
    assert engine.config.async_scheduling
    assert moved("raylane:steps_planned_ahead_total") >= 4


def _busier(snapshot: dict) -> dict:
    """Another replica's snapshot: every counter, histogram and finish count differs (and is
    non-zero), so a merge that dropped, doubled or mixed up a replica shows."""
    counters = {k: v + 10 + i for i, (k, v) in enumerate(snapshot["counters"].items())}
    histograms = {
        name: {**h, "counts": [c + 1 + i for i, c in enumerate(h["counts"])], "sum": h["sum"] + 2.5}
        for name, h in snapshot["histograms"].items()
    }
    finished = {
        **{r: c + 3 for r, c in snapshot["finished"].items()},
        "length": 5 + snapshot["finished"].get("length", 0),
        "abort": 2 + snapshot["finished"].get("abort", 0),
    }
    gauges = {
        **snapshot["gauges"],
        "kv_cache_usage_perc": 0.5,
        "num_requests_running": 3,
        "weight_version": 7,
    }
    return {
        **snapshot,
        "gauges": gauges,
        "counters": counters,
        "histograms": histograms,
        "finished": finished,
    }


def test_replica_snapshots_are_aggregated(engine):
    one = engine.stats_snapshot()
    busy = _busier(one)
    merged = samples(render("tiny", [one, busy]).decode())
    for name in ("prompt_tokens", "prefix_cache_hits", "generation_tokens"):
        want = one["counters"][name] + busy["counters"][name]
        assert value(merged, f"raylane:{name}_total") == want, name
    assert (
        value(merged, "raylane:num_requests_running") == 3 + one["gauges"]["num_requests_running"]
    )
    assert value(merged, "raylane:kv_cache_usage_perc") == pytest.approx(
        (0.5 + one["gauges"]["kv_cache_usage_perc"]) / 2
    )
    assert value(merged, "raylane:weight_version") == 7  # the newest, not a sum
    ttft = [s["histograms"]["time_to_first_token_seconds"] for s in (one, busy)]
    assert value(merged, "raylane:time_to_first_token_seconds_count") == sum(
        sum(h["counts"]) for h in ttft
    )
    assert value(merged, "raylane:time_to_first_token_seconds_sum") == pytest.approx(
        sum(h["sum"] for h in ttft)
    )
    for reason in set(one["finished"]) | set(busy["finished"]):
        want = one["finished"].get(reason, 0) + busy["finished"][reason]
        assert value(merged, "raylane:request_success_total", finished_reason=reason) == want
    empty = samples(render("tiny", []).decode())
    assert value(empty, "raylane:generation_tokens_total") == 0
    assert value(empty, "raylane:batch_invariant") == 0


def test_batch_invariant_is_1_only_when_every_replica_runs_the_mode(engine):
    on, off = _with_mode(engine.stats_snapshot(), 1), _with_mode(engine.stats_snapshot(), 0)
    for snapshots, want in (([on, on], 1), ([on, off], 0), ([off], 0)):
        assert value(samples(render("tiny", snapshots).decode()), "raylane:batch_invariant") == want


def _with_mode(snapshot: dict, flag: int) -> dict:
    return {**snapshot, "gauges": {**snapshot["gauges"], "batch_invariant": flag}}


def test_a_batch_invariant_engine_says_so(tiny_llama_dir):
    """The flag the routes show comes from the engine's own config: its stats snapshot (what
    /metrics renders) and the ModelInfo `local_backend` builds (/v1/models, /server_info)."""
    from raylane.actors.engine import AsyncLLMEngine, LLMEngine
    from raylane.session_server.backend import local_backend

    from tests.e2e.conftest import MODEL, tiny_config

    engine = LLMEngine(tiny_config(tiny_llama_dir, batch_invariant=True))
    try:
        scrape = samples(render(MODEL, [engine.stats_snapshot()]).decode())
        assert value(scrape, "raylane:batch_invariant") == 1
        assert local_backend(AsyncLLMEngine(engine), MODEL).info.batch_invariant is True
    finally:
        engine.shutdown()
