"""What the control plane remembers of each adapter, so that a replica the Router starts later
(a replacement, or one more when scaling up) serves the same adapters as the others before it
takes a request (`LoRAControl.admit`).

Per adapter: the path it was last loaded from, whether it is pinned, its newest committed
version's number and label, and, once tensors were pushed (`update_lora` over HTTP buckets, Ray
or gloo), that version's every tensor as one safetensors bucket in the Ray object store, put
there by the Router (so it lives as long as the Router does), read from a replica after the
commit answered (a replica admitted meanwhile waits for it). An adapter is small: rank 16 on
SmolLM2-135M is about 19.5 MB. A path load drops the tensors (the path is the adapter again);
an unloaded adapter is forgotten, and a replica that loads it at start (`lora_modules`) drops
it again when admitted. A Router that restarts has lost all of it, and recalls it from a live
replica (`recall`: the replicas hold the same adapters) once it learns of one, before it admits
a new replica: each adapter's path, pin, version and label as the replica lists them (those
still as its `lora_modules` loaded them aside: the spec's to say), for a version past the first
(it may have been pushed: its path alone would not make it) the tensors, read back from that
replica into the object store, and the `lora_modules` it no longer holds (unloaded: a new
replica drops them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LOG = logging.getLogger(__name__)


@dataclass
class AdapterRecord:
    """One adapter's newest committed state."""

    name: str
    path: str
    pinned: bool
    version: int
    label: str | int | None
    # tensor-pushed versions: the task putting its safetensors bucket in the object store
    tensors: asyncio.Task | None = None

    async def as_call(self) -> tuple[dict, Any]:
        """`restore_lora`'s arguments (the tensors as `[ObjectRef]`: a replica awaits it)."""
        record = {k: getattr(self, k) for k in ("name", "path", "pinned", "version", "label")}
        return record, None if self.tensors is None else [await self.tensors]

    async def described(self) -> dict[str, Any]:
        """The record, and whether its version's tensors are kept (once they are)."""
        record, tensors = await self.as_call()
        return {**record, "tensors": tensors is not None}


class LoRAMemory:
    """The adapters a replica must hold before it serves, by name."""

    def __init__(self) -> None:
        self.adapters: dict[str, AdapterRecord] = {}
        self.removed: set[str] = set()
        self.recalled = False  # what the replicas held when this Router started is known

    def loaded(self, info: dict[str, Any]) -> None:
        """Adapter `info` (a `LoRAInfo` dict) was loaded from its path on every replica."""
        self.removed.discard(info["name"])
        self.adapters[info["name"]] = AdapterRecord(
            info["name"], info["path"], info["pinned"], info["version"], info["version_label"]
        )

    @property
    def keeps_tensors(self) -> bool:
        """Under Ray (a local engine is never replaced: nothing to keep)."""
        import ray

        return ray.is_initialized()

    def pushed(self, info: dict[str, Any], export: asyncio.Task | None) -> None:
        """A version of adapter `info` was pushed as tensors; `export`: the task that puts
        all of them in the object store (its ObjectRef)."""
        self.loaded(info)
        self.adapters[info["name"]].tensors = export

    async def recall(self, replica: Any, export: Callable[[str], asyncio.Task | None]) -> None:
        """What `replica` (a live replica's `ReplicaControl`) holds becomes what is remembered,
        for every adapter not loaded, pushed or unloaded through this Router since it started
        (what it remembers of those is newer) nor held as `lora_modules` loaded it (the spec's
        business: a redeploy may drop it); the adapters it loaded at start and holds no more
        are unloaded ones. `export(name)`: the task that keeps the newest version's tensors
        (None where none are kept), past the first version."""
        try:
            held = await replica.list_loras()
            modules = {m["name"]: m["path"] for m in await replica.loaded_lora_modules()}
        except ValueError:  # LoRA is off on it: nothing to remember
            held, modules = [], {}
        unloaded = set(modules) - {info["name"] for info in held} - set(self.adapters)
        self.removed |= unloaded  # a new replica that loads them from `lora_modules` drops them
        for info in held:
            if info["name"] in self.adapters or info["name"] in self.removed:
                continue  # changed through this Router since it started
            if _as_configured(info, modules):
                continue  # every replica loads it before it serves
            self.pushed(info, export(info["name"]) if info["version"] > 1 else None)
        self.recalled = True

    def pinned(self, name: str) -> None:
        if name in self.adapters:
            self.adapters[name].pinned = True

    def forget(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.removed.add(name)

    async def restore(self, replica: Any) -> None:
        """Bring `replica` (its `ReplicaControl`) to every remembered adapter's state. An
        adapter it refuses (a ValueError: LoRA turned off by a redeploy, a smaller
        max_lora_rank, a path that is gone) is forgotten with a warning: the cluster as it is
        now configured cannot hold it, and the replica must still be able to start. So is one
        whose pushed tensors could not be read back (the replicas that held them went first)."""
        if not self.adapters and not self.removed:
            return  # nothing loaded or pushed at runtime (and a replica may have LoRA off)
        try:
            held = {a["name"] for a in await replica.list_loras()}
        except ValueError:  # LoRA is off on it: it holds none, and takes none below
            held = set()
        for name in sorted(self.removed & held):
            await replica.remove_lora(name, True)
        for record in list(self.adapters.values()):
            try:
                call = await record.as_call()
            except Exception as e:  # every replica it was to be read from went first
                self._forget(record.name, f"its tensors were never kept ({e!r})")
                continue
            try:
                await replica.restore_lora(*call)
            except ValueError as e:
                self._forget(record.name, f"a new replica refused it ({e})")

    def _forget(self, name: str, why: str) -> None:
        LOG.warning("LoRA adapter %r is forgotten: %s", name, why)
        self.adapters.pop(name, None)


def _as_configured(info: dict[str, Any], modules: dict[str, str]) -> bool:
    """Adapter `info` is as the replica's `lora_modules` loaded it: same path, its first
    version, not pinned."""
    return modules.get(info["name"]) == info["path"] and info["version"] == 1 and not info["pinned"]
