"""A control plane that restarted (a Router Ray restarted: it remembers nothing) recalls the
adapters loaded at runtime from a live replica before it admits a new one. Two in-process
engines stand for two replicas: through the first plane, "policy" is loaded, loaded again from
a second directory (version 2) and pinned, and "gone" (from `lora_modules` on every replica, as
"kept" is) is unloaded. A second plane over the same replica, as the restarted Router, recalls
"policy" only ("kept" is as `lora_modules` loaded it: the spec's business), and admits a new
engine (which loaded both modules again): the new engine then holds "policy" as the first does
(path, version, pin) and "kept", serves PEFT's tokens of version 2, and no longer holds "gone".
Without the recall the new engine would hold "gone" and not "policy". References: the first
engine's own listing, PeftModel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from raylane.actors.engine import AsyncLLMEngine
from raylane.actors.replica_control import ReplicaControl
from raylane.router.actor import Router
from raylane.router.control import ControlPlane

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.tiny_models import make_llama

PROMPT = [5, 17, 42, 99, 7]
N = 5
KEPT = ("name", "path", "version", "version_label", "pinned")


class Replicas:
    """The control plane's `ReplicaTable` and `ReplicaCalls` over in-process engines (as
    `LocalReplica` is over one): `live` are those it reaches."""

    def __init__(self) -> None:
        self.controls: dict[str, ReplicaControl] = {}
        self.live: list[str] = []

    def replica(self, replica_id: str) -> ReplicaControl:
        return self.controls[replica_id]

    def reachable(self) -> list[str]:
        return list(self.live)

    def weight_version(self) -> int:
        return 0

    def set_version(self, replica_id: str, version: int) -> None:
        pass

    def report_failure(self, replica_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_recall")
    base = make_llama(root / "base")
    paths = {n: make_adapter(base, root / n, seed=s, r=4) for n, s in (("v1", 71), ("v2", 72))}
    paths["gone"] = make_adapter(base, root / "gone", seed=73, r=4)
    expected = peft_greedy(peft_models(base, paths), "v2", PROMPT, N)[0]
    return base, paths, expected


@pytest.fixture
async def replicas(setup) -> AsyncIterator[Replicas]:
    base, paths, _ = setup
    table = Replicas()
    for rid in ("first", "new"):
        config = EngineConfig(
            model=base, enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=8
        )
        table.controls[rid] = ReplicaControl(AsyncLLMEngine(LLMEngine(config)))
        modules = [{"name": "gone", "path": paths["gone"]}, {"name": "kept", "path": paths["v1"]}]
        await table.controls[rid].load_lora_modules(modules)
    try:
        yield table
    finally:
        for control in table.controls.values():
            control.engine.engine.shutdown()


async def listed(control: ReplicaControl) -> dict[str, tuple]:
    return {a["name"]: tuple(a[k] for k in KEPT) for a in await control.list_loras()}


async def test_a_restarted_plane_recalls_runtime_adapters_before_it_admits(replicas, setup):
    _, paths, expected = setup
    replicas.live = ["first"]
    before = ControlPlane(replicas, replicas)
    await before.load_lora("policy", paths["v1"])
    await before.load_lora("policy", paths["v2"], replace=True)  # version 2
    await before.pin_lora("policy")
    await before.unload_lora("gone")
    held = await listed(replicas.controls["first"])
    assert set(held) == {"policy", "kept"} and held["policy"][2:] == (2, None, True)

    restarted = ControlPlane(replicas, replicas)  # remembers nothing
    remembered = await restarted.remembered_loras()
    assert [
        tuple(r[k] for k in ("name", "path", "version", "label", "pinned")) for r in remembered
    ] == [held["policy"]]
    await restarted.admit(replicas.controls["new"], lambda: replicas.live.append("new"))
    assert await listed(replicas.controls["new"]) == held  # "gone" dropped, "policy" as held
    engine = replicas.controls["new"].engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=N)
    out = engine.generate([PROMPT], params, False, LoRARequest("policy", 1))[0]
    assert list(out.outputs[0].token_ids) == expected


async def test_a_router_recalls_when_a_replica_it_did_not_start_heartbeats(replicas, setup):
    """The Router's own trigger: a heartbeat from a replica missing from its table (it
    restarted) recalls from that replica, in the background, before anything else asks."""
    _, paths, _ = setup
    replicas.live = ["first"]
    await ControlPlane(replicas, replicas).load_lora("policy", paths["v1"], pinned=True)
    router = Router(capacity=8)  # the plain class, its replicas in process (as injected)
    router.plane.calls = replicas
    router.heartbeat("first", 0, 0, 0, {}, [], {"policy": [1]})
    await asyncio.gather(*router.plane._detached)
    memory = router.plane.lora_memory
    assert memory.recalled and list(memory.adapters) == ["policy"]
    assert memory.adapters["policy"].pinned and memory.adapters["policy"].path == paths["v1"]
