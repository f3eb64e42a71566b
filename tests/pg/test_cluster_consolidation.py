"""A cluster config with a `consolidation:` section: the actor `raylane serve` starts
consolidates on its schedule through the cluster's own HTTP app (SmolLM2, behind an API key),
and the app's /metrics shows its counters, and still answers once the actor is gone. The app a
RayService deploys (`raylane.serve:app_builder`) starts that actor itself, once. Also the
actor's scheduled passes over every bank (a fake LLM: fast)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from raylane.actors.consolidation import MemoryStore
from raylane.config import ClusterConfig
from raylane.consolidation import metrics_sources, start_consolidation, stop_consolidation
from raylane.serve import served_model_name

from tests.e2e.server import ServerThread
from tests.pg.checks import assert_each_memory_once
from tests.support.fake_llm import FakeLLM

ray = pytest.importorskip("ray")

KEY = "sk-consolidation-test"
ITEMS = [
    ("The user prefers tea over coffee.", ["prefs"]),
    ("The user drinks green tea every morning.", ["prefs"]),
]  # one LLM call: keeps it fast


@pytest.fixture
def served_app(smollm2_dir, pg_dsn, bank):
    """The HTTP app as the Ingress builds it, for a config whose section names `bank`."""
    from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
    from raylane.session_server.app import build_app
    from raylane.session_server.backend import local_backend

    config = ClusterConfig(
        served_model_name="smollm2",
        api_keys=(KEY,),
        consolidation={
            "dsn": pg_dsn,
            "banks": [bank],
            "interval_s": 0.5,
            "llm_batch_size": 2,
            "max_tokens": 512,
        },
    )
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", num_kv_blocks=512))
    backend = local_backend(AsyncLLMEngine(engine), served_model_name(config))
    app = build_app(
        backend, api_keys=list(config.api_keys), metrics_sources=metrics_sources(config)
    )
    with ServerThread(app) as server:
        yield config, server.url
    engine.shutdown()


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


async def _until_a_pass_completed(
    client: httpx.AsyncClient, timeout_s: float = 120.0
) -> dict[str, float]:
    # one LLM call takes ~10 s here, several times that when other jobs load the machine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = await _scrape(client)
        if samples.get("raylane:consolidation_passes_total[('result', 'completed')]", 0) >= 1:
            return samples
        await asyncio.sleep(0.25)
    raise AssertionError(f"no consolidation pass completed within {timeout_s:.0f} s")


@pytest.mark.slow
async def test_cluster_consolidates_on_schedule_and_reports_on_metrics(
    ray_cluster, served_app, store, bank
) -> None:
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
        assert (
            consolidated + skipped,
            samples["raylane:consolidation_memories_total[('outcome', 'failed')]"],
        ) == (len(ITEMS), 0)
        assert samples["raylane:consolidation_observations_total[('action', 'create')]"] == len(
            observations
        )
        assert samples["raylane:consolidation_llm_calls_total[('result', 'ok')]"] >= 1
        assert samples["raylane:consolidation_last_pass_duration_seconds[]"] > 0
        assert samples["raylane:consolidation_passes_total[('result', 'failed')]"] == 0
        assert "raylane:num_requests_running[('model_name', 'smollm2')]" in samples
        skipped_ids = {m.id for m in await store.memories(bank)} - {
            i for o in observations for i in o.source_memory_ids
        }
        assert len(skipped_ids) == skipped
        await assert_each_memory_once(store, bank, skipped=skipped_ids)

        after = await _scrape(client)  # the actor is gone: the engines' metrics still answer
        assert "raylane:num_requests_running[('model_name', 'smollm2')]" in after
        assert not any(name.startswith("raylane:consolidation") for name in after)


def _consolidation_actors_ever() -> int:
    from ray._private.state import actors
    from raylane.consolidation import ACTOR_NAME

    return sum(a["Name"] == ACTOR_NAME for a in actors().values())


@pytest.fixture
def import_path_app(ray_cluster, smollm2_dir, pg_dsn, bank, monkeypatch):
    """The app as a RayService deploys it: `serve.run(app_builder(args))`, nothing else started;
    yields (args, url, how many actors by the actor's name Ray had seen before)."""
    from ray import serve
    from raylane.router.names import NAMESPACE, ROUTER_NAME
    from raylane.serve import app_builder

    from tests.ray.conftest import free_port

    for key in (
        "RAYLANE_CONFIG",
        "RAYLANE_MODEL",
        "RAYLANE_API_KEYS",
        "RAYLANE_SESSIONS_DSN",
        "RAYLANE_CONSOLIDATION_DSN",
    ):
        monkeypatch.delenv(key, raising=False)
    args = {
        "model": smollm2_dir,
        "served_model_name": "smollm2",
        "api_keys": [KEY],
        "torch_threads": 1,
        "engine": {"dtype": "float32", "num_kv_blocks": 512},
        "consolidation": {
            "dsn": pg_dsn,
            "banks": [bank],
            "interval_s": 0.5,
            "llm_batch_size": 2,
            "max_tokens": 512,
        },
    }
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    before = _consolidation_actors_ever()
    try:
        serve.run(app_builder(args), name="raylane", route_prefix="/")
        yield args, f"http://127.0.0.1:{port}", before
    finally:
        stop_consolidation()
        serve.shutdown()
        ray.kill(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE))


@pytest.mark.slow
async def test_the_import_path_app_starts_the_actor_once(import_path_app, store, bank) -> None:
    """No `raylane serve` here: the Ingress starts the actor against the Serve HTTP address
    once the app answers, and it consolidates; `raylane serve`'s own start (after the same
    health check) gets that actor instead of starting a second."""
    from tests.ray.conftest import wait_for

    args, url, before = import_path_app
    await store.retain_many(bank, ITEMS)  # a pass may have run before: wait for these
    deadline = time.monotonic() + 120.0
    while await store.pending_banks([bank]):
        assert time.monotonic() < deadline, "the memories were not consolidated within 120 s"
        await asyncio.sleep(0.25)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        samples = await _until_a_pass_completed(client)
    assert samples["raylane:consolidation_llm_calls_total[('result', 'ok')]"] >= 1
    assert samples["raylane:consolidation_memories_total[('outcome', 'failed')]"] == 0
    assert await store.all_observations(bank)  # the model answered through the app's endpoint
    config = ClusterConfig(
        served_model_name="smollm2", api_keys=(KEY,), consolidation=args["consolidation"]
    )
    start_consolidation(config, url, served_model_name(config))  # as `raylane serve` does
    wait_for(lambda: _consolidation_actors_ever() > before, 30, "the actor's record")
    assert _consolidation_actors_ever() == before + 1


async def test_passes_over_every_bank_are_scheduled_and_counted(ray_cluster, fresh_dsn) -> None:
    """`banks: all`: each pass finds the banks with pending memories itself (a fresh database,
    so other tests' banks stay out of it)."""
    from raylane.actors.consolidation.actor import ConsolidationActor

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
        samples = {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(await actor.metrics_text.remote())
            for s in family.samples
        }
        assert samples["raylane:consolidation_passes_total[('result', 'completed')]"] >= 1
        assert samples["raylane:consolidation_memories_total[('outcome', 'consolidated')]"] == 3
        assert not any(name.startswith("process_") for name in samples)  # only its own
    finally:
        ray.kill(actor)
        await store.close()


def test_an_unreachable_database_stops_the_start_and_leaves_no_actor(ray_cluster) -> None:
    from raylane.consolidation import ACTOR_NAME, NAMESPACE
    from raylane.launch import free_port

    dsn = f"postgresql://raylane:pw-secret-4@127.0.0.1:{free_port()}/memories"  # nobody there
    config = ClusterConfig(consolidation={"dsn": dsn})
    with pytest.raises(ValueError, match="cannot use the database") as info:
        start_consolidation(config, "http://127.0.0.1:9", "m")
    assert "secret" not in str(info.value)
    with pytest.raises(ValueError):
        ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
