"""A cluster config with a `consolidation:` section: the actor `raylane serve` starts
consolidates on its schedule through the cluster's own HTTP app (SmolLM2, behind an API key),
and the app's /metrics shows its counters, and still answers once the actor is gone. Also the
actor's scheduled passes over every bank (a fake LLM: fast)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.consolidation import MemoryStore
from actors.consolidation.fake_llm import FakeLLM
from cluster.config import ClusterConfig
from cluster.consolidation import metrics_sources, start_consolidation, stop_consolidation
from cluster.serve import served_model_name
from tests.e2e.server import ServerThread
from tests.pg.checks import assert_each_memory_once

ray = pytest.importorskip("ray")

KEY = "sk-consolidation-test"
ITEMS = [("The user prefers tea over coffee.", ["prefs"]),
         ("The user drinks green tea every morning.", ["prefs"])]  # one LLM call: keeps it fast


@pytest.fixture
def served_app(smollm2_dir, pg_dsn, bank):
    """The HTTP app as the Ingress builds it, for a config whose section names `bank`."""
    from actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
    from session_server.app import build_app
    from session_server.backend import LocalBackend

    config = ClusterConfig(served_model_name="smollm2", api_keys=(KEY,), consolidation={
        "dsn": pg_dsn, "banks": [bank], "interval_s": 0.5, "llm_batch_size": 2,
        "max_tokens": 512})
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", num_kv_blocks=512))
    backend = LocalBackend(AsyncLLMEngine(engine), served_model_name(config))
    app = build_app(backend, api_keys=list(config.api_keys),
                    metrics_sources=metrics_sources(config))
    with ServerThread(app) as server:
        yield config, server.url
    engine.shutdown()


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


async def _until_a_pass_completed(client: httpx.AsyncClient,
                                  timeout_s: float = 120.0) -> dict[str, float]:
    # one LLM call takes ~10 s here, several times that when other jobs load the machine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = await _scrape(client)
        if samples.get("raylane:consolidation_passes_total[('result', 'completed')]", 0) >= 1:
            return samples
        await asyncio.sleep(0.25)
    raise AssertionError(f"no consolidation pass completed within {timeout_s:.0f} s")


@pytest.mark.slow
async def test_cluster_consolidates_on_schedule_and_reports_on_metrics(ray_cluster, served_app,
                                                                       store, bank) -> None:
    config, url = served_app
    await store.retain_many(bank, ITEMS)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        start_consolidation(config, url, served_model_name(config))
        try:
            samples = await _until_a_pass_completed(client)
        finally:
            stop_consolidation()
        observations = await store.all_observations(bank)
        assert observations  # the model wrote what it learned
        consolidated = samples["raylane:consolidation_memories_total[('outcome', 'consolidated')]"]
        skipped = samples["raylane:consolidation_memories_total[('outcome', 'skipped')]"]
        assert (consolidated + skipped, samples[
            "raylane:consolidation_memories_total[('outcome', 'failed')]"]) == (len(ITEMS), 0)
        assert samples["raylane:consolidation_observations_total[('action', 'create')]"] == len(
            observations)
        assert samples["raylane:consolidation_llm_calls_total[('result', 'ok')]"] >= 1
        assert samples["raylane:consolidation_last_pass_duration_seconds[]"] > 0
        assert samples["raylane:consolidation_passes_total[('result', 'failed')]"] == 0
        assert "raylane:num_requests_running[('model_name', 'smollm2')]" in samples
        skipped_ids = {m.id for m in await store.memories(bank)} - {
            i for o in observations for i in o.source_memory_ids}
        assert len(skipped_ids) == skipped
        await assert_each_memory_once(store, bank, skipped=skipped_ids)

        after = await _scrape(client)  # the actor is gone: the engines' metrics still answer
        assert "raylane:num_requests_running[('model_name', 'smollm2')]" in after
        assert not any(name.startswith("raylane:consolidation") for name in after)


async def test_passes_over_every_bank_are_scheduled_and_counted(ray_cluster, fresh_dsn) -> None:
    """`banks: all`: each pass finds the banks with pending memories itself (a fresh database,
    so other tests' banks stay out of it)."""
    from actors.consolidation.actor import ConsolidationActor

    store = await MemoryStore.connect(fresh_dsn)
    actor = ConsolidationActor.remote(fresh_dsn, FakeLLM, every_s=0.1)
    try:
        await store.retain_many("bank-a", [("a1", ["x"]), ("a2", ["y"])])
        await store.retain_many("bank-b", [("b1", ["x"])])
        for _ in range(300):
            if not await store.pending_banks():
                break
            await asyncio.sleep(0.05)
        assert await store.pending_banks() == []
        for bank_id in ("bank-a", "bank-b"):
            await assert_each_memory_once(store, bank_id)
        samples = {f"{s.name}{sorted(s.labels.items())}": s.value for family in
                   text_string_to_metric_families(await actor.metrics_text.remote())
                   for s in family.samples}
        assert samples["raylane:consolidation_passes_total[('result', 'completed')]"] >= 1
        assert samples["raylane:consolidation_memories_total[('outcome', 'consolidated')]"] == 3
        assert not any(name.startswith("process_") for name in samples)  # only its own
    finally:
        ray.kill(actor)
        await store.close()


def test_an_unreachable_database_stops_the_start_and_leaves_no_actor(ray_cluster) -> None:
    from actors.consolidation.pgtemp import free_port
    from cluster.consolidation import ACTOR_NAME, NAMESPACE

    dsn = f"postgresql://raylane:pw-secret-4@127.0.0.1:{free_port()}/memories"  # nobody there
    config = ClusterConfig(consolidation={"dsn": dsn})
    with pytest.raises(ValueError, match="cannot use the database") as info:
        start_consolidation(config, "http://127.0.0.1:9", "m")
    assert "secret" not in str(info.value)
    with pytest.raises(ValueError):
        ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
