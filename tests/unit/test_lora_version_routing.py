"""A request that asks for one version of an adapter goes to a replica that holds it. Two engines
stand for two replicas: one ("old") runs a request on version 1 when version 2 arrives, so it
holds both; the other ("new", started after the update, as a replacement would be) holds
version 2 only and refuses version 1 (LoRAVersionGone: a 409). With their held versions as the
heartbeat reports them, the routing policy sends every version-1 request to "old", a routing key
owned by "new" included, while version 2 and unversioned requests still go to both; the
version-1 request then runs there with PEFT's tokens. References: each engine's own admission
and PeftModel."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from raylane.actors.lora import LoRAVersionGone
from raylane.actors.replica_lora import LoRAName
from raylane.router.actor import Router
from raylane.router.policy import HashRing, RoutingPolicy
from raylane.router.replica_view import ReplicaView

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.tiny_models import make_llama

PROMPT = [5, 17, 42, 99, 7]
N = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=N)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_version_routing")
    base = make_llama(root / "base")
    paths = {v: make_adapter(base, root / v, seed=s, r=4) for v, s in (("v1", 61), ("v2", 62))}
    expected = peft_greedy(peft_models(base, paths), "v1", PROMPT, N)[0]
    return base, paths, expected


@pytest.fixture
def engines(setup) -> Iterator[dict[str, LLMEngine]]:
    base, paths, _ = setup
    made = {
        rid: LLMEngine(EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8))
        for rid in ("old", "new")
    }
    old, new = made["old"], made["new"]
    old.add_lora(LoRARequest("policy", 1, paths["v1"]))
    old.add_request("running", PROMPT, PARAMS, lora_request=LoRARequest("policy", 1))
    old.step()  # "running" is on version 1
    for engine in (old, new):  # version 2: loaded again from a new path
        if engine is new:
            engine.add_lora(LoRARequest("policy", 1, paths["v1"]))
        engine.add_lora(LoRARequest("policy", 1, paths["v2"]))
    try:
        yield made
    finally:
        for engine in made.values():
            engine.shutdown()


def routing(engines: dict[str, LLMEngine]) -> RoutingPolicy:
    """The policy as the heartbeats leave it: each replica's held versions."""
    policy = RoutingPolicy(capacity=8)
    for rid, engine in engines.items():
        policy.add(rid)
        policy.replicas[rid].set_lora_versions(engine.loras.held_versions())
    return policy


def key_owned_by(replica_id: str, ring: HashRing) -> str:
    return next(k for i in range(1000) if next(ring.walk(k := f"key-{i}")) == replica_id)


def run(engine: LLMEngine, request_id: str, version: int) -> list[int]:
    lora = LoRARequest("policy", 1, version=version)
    engine.add_request(request_id, PROMPT, PARAMS, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return list(done[request_id].token_ids)


def test_a_version_goes_where_it_is_held(engines, setup):
    _, _, expected = setup
    assert engines["old"].loras.held_versions() == {"policy": [1, 2]}
    assert engines["new"].loras.held_versions() == {"policy": [2]}
    with pytest.raises(LoRAVersionGone):  # the premise: "new" would refuse it
        run(engines["new"], "refused", 1)
    policy = routing(engines)
    v1, v2 = LoRAName("policy", 1), LoRAName("policy", 2)
    assert {policy.choose(lora=v1) for _ in range(6)} == {"old"}
    owned_by_new = key_owned_by("new", policy.ring)
    assert policy.choose(routing_key=owned_by_new) == "new"  # the key's owner is "new"...
    assert policy.choose(routing_key=owned_by_new, lora=v1) == "old"  # ...but it lacks v1
    assert {policy.choose(lora=v2) for _ in range(6)} == {"old", "new"}
    assert {policy.choose(lora="policy") for _ in range(6)} == {"old", "new"}
    chosen = policy.choose(lora=v1)
    assert run(engines[chosen], "asked", 1) == expected


def test_a_version_no_replica_reports_may_go_anywhere(engines):
    # just committed, before any heartbeat says so: every replica may answer or refuse it
    policy = routing(engines)
    assert {policy.choose(lora=LoRAName("policy", 3)) for _ in range(6)} == {"old", "new"}


def test_the_heartbeat_carries_the_versions_to_every_view(engines):
    router = Router(capacity=8)  # the plain class: Ray wraps it only when it is started
    for rid, engine in engines.items():
        router.replica_set.handles[rid] = f"{rid}'s handle"
        router.register(rid)
        held = engine.loras.held_versions()
        router.heartbeat(rid, 0, 0, 0, {}, [], held)  # as the replica sends it

    async def fetch(known):
        return await router.table(None, known)

    async def picks(lora: str) -> set[str | None]:
        view = ReplicaView(fetch, 8, router.report_failure, refresh_s=3600)
        chosen = set()
        for _ in range(4):
            chosen.add(rid := await view.choose(lora=lora))
            view.done(rid)
        return chosen

    assert asyncio.run(picks(LoRAName("policy", 1))) == {"old"}
    assert asyncio.run(picks(LoRAName("policy", 2))) == {"old", "new"}
    rows = {r["replica_id"]: r["lora_versions"] for r in router.replicas()}
    assert rows == {"old": {"policy": [1, 2]}, "new": {"policy": [2]}}
