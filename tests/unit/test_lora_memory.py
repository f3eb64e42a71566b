"""The control plane's adapter memory (router/lora_memory.py) restoring onto a new replica: an
adapter the replica refuses (here: LoRA turned off by a redeploy), or one whose pushed tensors
were never kept (every replica they were to be read from went first), is forgotten, and the
replica still starts; one it takes is restored."""

from __future__ import annotations

import asyncio

from raylane.router.lora_memory import LoRAMemory


class Replica:
    """A replica's adapter verbs as the control plane calls them: `accepts` says whether its
    engine has LoRA on (the engine's own refusal is a ValueError naming the field)."""

    def __init__(self, accepts: bool) -> None:
        self.accepts = accepts
        self.restored: list[str] = []

    async def list_loras(self) -> list[dict]:
        if not self.accepts:
            raise ValueError("LoRA is off (EngineConfig.enable_lora=False)")
        return []

    async def remove_lora(self, name: str, wait: bool) -> None:
        raise AssertionError("nothing to remove")

    async def restore_lora(self, record: dict, tensors=None) -> int:
        if not self.accepts:
            raise ValueError("lora_request: LoRA is off (EngineConfig.enable_lora=False)")
        self.restored.append(record["name"])
        return record["version"]


def info(name: str) -> dict:
    return {"name": name, "path": f"/a/{name}", "pinned": False, "version": 2, "version_label": 2}


async def test_a_replica_with_lora_off_starts_when_nothing_is_remembered():
    await LoRAMemory().restore(Replica(accepts=False))


async def test_an_adapter_a_new_replica_refuses_is_forgotten_and_it_starts_anyway():
    memory = LoRAMemory()
    memory.loaded(info("sql"))
    memory.loaded(info("math"))
    off = Replica(accepts=False)
    await memory.restore(off)  # does not raise: the replica starts
    assert off.restored == [] and memory.adapters == {}

    memory.loaded(info("sql"))
    on = Replica(accepts=True)
    await memory.restore(on)
    assert on.restored == ["sql"] and list(memory.adapters) == ["sql"]


async def test_an_adapter_whose_tensors_were_never_kept_is_forgotten_and_it_starts_anyway():
    async def lost() -> None:
        raise RuntimeError("no replica of the update kept adapter 'sql''s tensors")

    memory = LoRAMemory()
    memory.pushed(info("sql"), asyncio.ensure_future(lost()))
    memory.loaded(info("math"))
    on = Replica(accepts=True)
    await memory.restore(on)  # does not raise: the replica starts
    assert on.restored == ["math"] and list(memory.adapters) == ["math"]
