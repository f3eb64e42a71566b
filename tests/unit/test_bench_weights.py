"""`raylane bench weights`' pure helpers: reading /metrics, and the per-token version check."""

from __future__ import annotations

from raylane.bench.weights_pause import _metric, _switches_once

METRICS = """# HELP raylane:num_requests_running Number of requests in model execution batches.
# TYPE raylane:num_requests_running gauge
raylane:num_requests_running{model_name="bench"} 32.0
raylane:num_requests_running_extra{model_name="bench"} 7.0
# TYPE raylane:generation_tokens counter
raylane:generation_tokens_total{model_name="bench"} 120.0
raylane:generation_tokens_created{model_name="bench"} 1.7e9
"""


def test_metric_sums_a_family_by_exact_name():
    assert _metric(METRICS, "raylane:num_requests_running") == 32.0
    assert _metric(METRICS, "raylane:generation_tokens") == 120.0
    assert _metric(METRICS, "raylane:num_requests_waiting") == 0.0


def test_switches_once_at_the_update():
    assert _switches_once([3, 3, 4, 4], 4)
    assert not _switches_once([4, 4], 4)  # all new: it did not span the update
    assert not _switches_once([3, 3], 4)
    assert not _switches_once([3, 4, 3, 4], 4)
    assert not _switches_once([2, 3, 4], 4)


def test_both_cache_policies_stop_stale_hits_and_keep_the_cache_working():
    from benchmarks.cache_versions import measure

    unsafe = measure("none", num_prompts=4, prompt_blocks=5, block_size=4)
    assert unsafe.stale_hits > 0  # the hazard: old KV found after the update
    for policy in ("fold", "flush"):
        row = measure(policy, num_prompts=4, prompt_blocks=5, block_size=4)
        assert row.stale_hits == 0 and row.hits_after == unsafe.stale_hits
