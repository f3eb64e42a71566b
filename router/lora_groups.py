"""The control plane's part for adapter-only updates over the trainer's collective group (gloo
on the CPU): every replica joins the trainer's adapter group as one rank (the trainer is rank
0, replica i is `rank_offset + i`), and what the trainer broadcasts lands in the open adapter
update (`begin_lora_update`: checked on every rank before a byte moves), which commits on every
replica or none (`commit_lora_update`). A receive that fails anywhere drops the update
everywhere: every replica keeps the adapter's old version.

A trainer's sequence: `init_lora_group(info)` while its own process joins as rank 0, then per
update `begin_lora_update(name, specs)`, `receive_lora(update_id, group)` while it broadcasts
the tensors in `specs`' order (one broadcast each), `commit_lora_update(update_id)`.
"""

from __future__ import annotations

from typing import Any

from raylane.router.control_parts import all_or_none
from raylane.router.errors import ReplicasFailed
from raylane.router.lora_control import LoRAControl


class LoRAGroups(LoRAControl):
    """`ControlPlane`'s adapter verbs over the trainer's collective group."""

    _lora_groups: dict[str, list[str]] | None = None  # group name -> the replicas in it

    async def init_lora_group(self, info: dict[str, Any]) -> dict[str, Any]:
        """Every healthy replica joins the trainer's adapter group (`GroupInfo`'s fields:
        `world_size` = 1 + the replicas, `rank_offset` 1); all join or none stays in. Returns
        each replica's rank."""
        from raylane.actors.runner.group_info import GroupInfo

        if not isinstance(info, dict):
            raise ValueError("init_info: give {master_address, master_port, rank_offset, ...}")
        group = GroupInfo(**info)
        async with self._lock:
            ids = self._reachable()
            if group.world_size != group.rank_offset + len(ids):
                raise ValueError(
                    f"world_size: {group.world_size} ranks, but the trainer's "
                    f"{group.rank_offset} and one per replica ({len(ids)}) make "
                    f"{group.rank_offset + len(ids)}"
                )
            ranks = {rid: group.rank_offset + i for i, rid in enumerate(ids)}
            try:
                await all_or_none(
                    ids, lambda rid: self.calls.replica(rid).join_lora_group(info, ranks[rid])
                )
            except BaseException:
                await self._leave(ids, group.group_name)
                raise
            if self._lora_groups is None:
                self._lora_groups = {}
            self._lora_groups[group.group_name] = ids
            return {"group_name": group.group_name, "ranks": ranks}

    async def receive_lora(self, update_id: str | None, group_name: str) -> int:
        """Receive the open adapter update's tensors (its manifest, in order) from the
        trainer's broadcasts on every replica of the update; returns how many arrived."""
        async with self._lock:
            update = self._open_lora(update_id)
            members = (self._lora_groups or {}).get(group_name)
            if members is None:
                raise ValueError(f"group_name: no adapter group {group_name!r} (init it first)")
            missing = set(update.replica_ids) - set(members)
            if missing:
                raise ValueError(f"group_name: replicas {sorted(missing)} are not in the group")
            try:
                got = await all_or_none(
                    update.replica_ids,
                    lambda rid: self.calls.replica(rid).receive_lora(group_name, update.specs),
                )
            except ValueError:
                raise
            except BaseException as e:
                await self._drop_lora_update()
                raise ReplicasFailed(
                    f"receiving the adapter failed ({type(e).__name__}: {e}); the update was "
                    "rolled back, every replica keeps the adapter's old version"
                ) from e
            update.loaded = next(iter(got.values()))
            return update.loaded

    async def destroy_lora_group(self, group_name: str) -> None:
        """Every replica leaves the adapter group."""
        async with self._lock:
            ids = (self._lora_groups or {}).pop(group_name, None) or self._reachable()
            await self._leave(ids, group_name)

    async def _leave(self, ids: list[str], group_name: str) -> None:
        await all_or_none(ids, lambda rid: self.calls.replica(rid).leave_lora_group(group_name))
