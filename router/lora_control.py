"""The control plane's part for LoRA adapters: load, unload and list them on every replica, and
the adapter-only update, one transaction across every replica (`ControlPlane` has these: the
same lock as pause, resume and weight updates, so they never interleave).

An adapter update needs no pause: each engine applies the new version between steps, and a
request keeps the version it started on (`LLMEngine.update_lora`). The transaction is the weight
update's: `begin_lora_update` checks the adapter's tensors (PEFT names and shapes) on every rank
of every replica before any byte moves, and a `ValueError` anywhere aborts it everywhere, the old
version kept; `load_lora_bucket` applies a bucket on every replica of the transaction;
`commit_lora_update` switches them all to the new version. A replica that fails meanwhile leaves
the transaction and is reported (no more requests until it recovers).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raylane.router.broadcast import ReplicaBroadcast
from raylane.router.control_parts import manifest
from raylane.router.errors import UpdateNotFound
from raylane.router.lora_memory import LoRAMemory

log = logging.getLogger(__name__)


@dataclass
class LoRAUpdate:
    """An adapter update in progress."""

    update_id: str
    name: str
    replica_ids: list[str]
    specs: list[dict]  # the manifest, in the order a collective sender broadcasts them
    loaded: int = 0
    failed: list[str] = field(default_factory=list)


class LoRAControl(ReplicaBroadcast):
    """`ControlPlane`'s adapter verbs."""

    _lock: asyncio.Lock
    _detached: set[asyncio.Task]
    _lora_update: LoRAUpdate | None = None
    _lora_memory: LoRAMemory | None = None

    @property
    def lora_memory(self) -> LoRAMemory:
        """What a replica started later must hold before it serves (router/lora_memory.py)."""
        if self._lora_memory is None:
            self._lora_memory = LoRAMemory()
        return self._lora_memory

    async def admit(self, replica: Any, register: Callable[[], None]) -> None:
        """A replica that starts: it gets every remembered adapter, then `register` makes it
        routable, under the lock, so no adapter change falls between the two."""
        async with self._lock:
            await self._recall(self.table.reachable())
            await self.lora_memory.restore(replica)
            register()

    def recall_from(self, replica_id: str) -> None:
        """A live replica this Router did not start (it restarted and re-learns its table):
        unless done already, what it holds becomes what the Router remembers, in the
        background, under the lock (`LoRAMemory.recall`)."""
        if self.lora_memory.recalled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a Router called outside its actor's loop: its next admit recalls
            return

        async def recall() -> None:
            async with self._lock:
                await self._recall([replica_id])

        task = loop.create_task(recall())
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _recall(self, ids: list[str]) -> None:
        """Once: the adapters the first of `ids` that answers holds (they all hold the same)."""
        memory = self.lora_memory
        for rid in [] if memory.recalled else ids:
            try:
                replica = self.calls.replica(rid)
                await memory.recall(replica, functools.partial(self._keep, rid))
                return
            except Exception as e:  # gone meanwhile: the next one holds the same
                log.warning("recalling the LoRA adapters of replica %s failed: %r", rid, e)

    def _keep(self, replica_id: str, name: str) -> asyncio.Task | None:
        return self._export([replica_id], name) if self.lora_memory.keeps_tensors else None

    async def remembered_loras(self) -> list[dict[str, Any]]:
        """What a replica started now would get (router/lora_memory.py), recalled from the
        replicas first where this Router has not yet: per adapter its path, pin, version and
        label, and whether that version's tensors are kept (once they are)."""
        async with self._lock:
            await self._recall(self.table.reachable())
            records = list(self.lora_memory.adapters.values())
        return [await record.described() for record in records]

    async def _adapter(self, replica_id: str, name: str) -> dict[str, Any]:
        listed = await self.calls.replica(replica_id).list_loras()
        return next(a for a in listed if a["name"] == name)

    async def list_loras(self) -> list[dict[str, Any]]:
        """The adapters registered on the replicas (`LoRAInfo` as dicts, by the first healthy
        replica: every replica holds the same ones)."""
        ids = self._reachable()
        return await self.calls.replica(ids[0]).list_loras()

    async def load_lora(
        self, name: str, path: str, pinned: bool = False, replace: bool = False
    ) -> list[dict[str, Any]]:
        """Register adapter `name` from `path` on every replica; `replace`: a name already
        registered gets a new version from `path` (vLLM's `load_inplace`), else it is a
        `ValueError`. A `ValueError` on any replica (a bad adapter, every slot pinned) removes
        a new adapter from those that took it. Returns `list_loras()`."""
        async with self._lock:
            ids = self._reachable()
            known = {a["name"] for a in await self.calls.replica(ids[0]).list_loras()}
            if name in known and not replace:
                raise ValueError(f"lora_name: the lora adapter {name!r} has already been loaded")
            try:
                await self._everywhere(ids, "add_lora", lambda r: r.add_lora(name, path, pinned))
            except ValueError:
                if name not in known:  # nothing stays loaded anywhere
                    await self._undo_add(ids, name)
                raise
            self.lora_memory.loaded(await self._adapter(ids[0], name))
            return await self.calls.replica(ids[0]).list_loras()

    async def _undo_add(self, ids: list[str], name: str) -> None:
        calls = (self.calls.replica(rid).remove_lora(name, True) for rid in ids)
        await asyncio.gather(*calls, return_exceptions=True)  # absent where it failed

    async def unload_lora(self, name: str) -> None:
        """Remove adapter `name` from every replica; its requests in flight finish first. An
        unknown name raises the engine's `LoRANotFound` (404)."""
        from raylane.actors.lora.errors import LoRANotFound

        async with self._lock:
            removed = await self._everywhere(
                self._reachable(), "remove_lora", lambda r: r.remove_lora(name, True)
            )
            self.lora_memory.forget(name)
            if not any(removed.values()):
                raise LoRANotFound(f"lora_name {name!r}: no adapter of that name is loaded")

    async def pin_lora(self, name: str) -> None:
        """Keep adapter `name` in a slot on every replica (SGLang's `pinned`)."""
        async with self._lock:
            await self._everywhere(self._reachable(), "pin_lora", lambda r: r.pin_lora(name))
            self.lora_memory.pinned(name)

    # --- the adapter-only update transaction --------------------------------------------------

    async def begin_lora_update(self, name: str, spec_dicts: list[dict]) -> str:
        """Open an update of adapter `name`'s tensors (`spec_dicts`: {"name", "shape",
        "dtype"} under PEFT's names), checked on every rank of every replica first; a
        `ValueError` leaves every replica as it was. Replaces an update not committed."""
        specs = [s.to_dict() for s in manifest(spec_dicts)]
        async with self._lock:
            await self._drop_lora_update()
            ids = self._reachable()
            try:
                ok = await self._everywhere(
                    ids, "begin_lora_update", lambda r: r.begin_lora_update(name, specs)
                )
            except ValueError:
                await self._abort_on(ids)
                raise
            update_id = f"lora-{secrets.token_hex(8)}"
            self._lora_update = LoRAUpdate(update_id, name, list(ok), specs)
            return update_id

    async def load_lora_bucket(self, update_id: str | None, bucket: Any) -> int:
        """Apply one bucket (safetensors bytes, or `[ObjectRef]` of them) on every replica of
        the update; how many tensors it held. A `ValueError` changes nothing."""
        async with self._lock:
            update = self._open_lora(update_id)
            ok = await self._everywhere(
                update.replica_ids, "load_lora_bucket", lambda r: r.load_lora_bucket(bucket)
            )
            update.replica_ids = list(ok)  # those that failed left
            count = next(iter(ok.values()))
            update.loaded += count
            return count

    async def commit_lora_update(
        self, update_id: str | None, version: int | str | None = None
    ) -> int:
        """Switch every replica of the update to the adapter's new version (`version`: its
        label; None: the next integer). Returns the adapter's version."""
        async with self._lock:
            update = self._open_lora(update_id)
            if update.loaded < len(update.specs):
                raise ValueError(
                    f"only {update.loaded} of the update's {len(update.specs)} tensors were "
                    "loaded; send the rest before committing"
                )
            ok = await self._everywhere(
                update.replica_ids,
                "finish_lora_update",
                lambda r: r.finish_lora_update(version),
            )
            self._lora_update = None
            await self._remember_push(list(ok), update.name)
            return max(ok.values())

    async def _remember_push(self, ids: list[str], name: str) -> None:
        memory = self.lora_memory
        export = self._export(ids, name) if memory.keeps_tensors else None
        memory.pushed(await self._adapter(ids[0], name), export)

    def _export(self, ids: list[str], name: str) -> asyncio.Task:
        """The adapter's tensors, read from the first replica of `ids` that answers and put in
        the object store by the Router, after the commit answered (a restore awaits it)."""

        async def export() -> Any:
            import ray

            for rid in ids:
                try:
                    return ray.put(await self.calls.replica(rid).lora_tensors(name))
                except Exception as e:  # gone since the commit: the next one has them too
                    log.warning("reading adapter %r from replica %s failed: %r", name, rid, e)
            raise RuntimeError(f"no replica of the update kept adapter {name!r}'s tensors")

        return asyncio.get_running_loop().create_task(export())

    async def abort_lora_update(self, update_id: str | None = None) -> None:
        """Drop the open adapter update everywhere; every replica keeps the old version."""
        async with self._lock:
            if update_id is not None:
                self._open_lora(update_id)
            await self._drop_lora_update()

    async def _drop_lora_update(self) -> None:
        update, self._lora_update = self._lora_update, None
        if update is not None:
            await self._abort_on(update.replica_ids)

    async def _abort_on(self, ids: list[str]) -> None:
        calls = (self.calls.replica(rid).abort_lora_update() for rid in ids)
        await asyncio.gather(*calls, return_exceptions=True)

    def _open_lora(self, update_id: str | None) -> LoRAUpdate:
        update = self._lora_update
        if update is None or update_id not in (None, update.update_id):
            raise UpdateNotFound(
                f"no adapter update {update_id!r} is open (never begun, committed, or "
                "replaced by a newer begin)",
                param="update_id",
            )
        return update
