"""The control plane's part for a trainer's collective weight-update groups: every rank of
every replica joins the trainer's group, and what the trainer broadcasts over it is received as
loads of the control plane's one open update (`ControlPlane`, which this is a part of: same
lock, same update, same commit)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from raylane.actors.runner.group_info import GroupInfo
from raylane.router.broadcast import ReplicaBroadcast
from raylane.router.control_parts import Update, all_or_none, manifest
from raylane.router.errors import ControlConflict, ReplicasFailed

T = TypeVar("T")


class WeightGroups(ReplicaBroadcast):
    """`ControlPlane`'s methods for the trainer's groups (`_groups`: group name -> the
    replicas in it)."""

    _lock: asyncio.Lock
    _update: Update | None
    _groups: dict[str, list[str]]
    _detached: set[asyncio.Task]
    _detached_failure: BaseException | None = None  # a detached join's or receive's

    def _open(self, update_id: str | None) -> Update:
        raise NotImplementedError  # ControlPlane's

    async def _resume_after_commit(self) -> None:
        raise NotImplementedError  # ControlPlane's

    async def init_weight_group(
        self, info: dict[str, Any], detach: bool = False
    ) -> dict[str, Any] | None:
        """Every rank of every healthy replica joins the trainer's group (`GroupInfo`'s
        fields), replica i's ranks after replica i-1's, from `rank_offset`; `world_size` must
        count them exactly. All join or none stays in. Returns the group's ranks.

        `detach`: return once the group is checked, and join in the background (TRL's trainer
        joins only after its init call returned); a failure is raised by the next call."""
        group = GroupInfo(**info) if isinstance(info, dict) else None
        if group is None:
            raise ValueError("init_info: give {master_address, master_port, rank_offset, ...}")
        return await self._detachable(lambda ready: self._init(group, info, ready), detach)

    async def _init(
        self, group: GroupInfo, info: dict[str, Any], ready: asyncio.Future | None
    ) -> dict[str, Any]:
        async with self._lock:
            self._detached_failure = None  # a new group: the old one's failure is moot
            ids = self._reachable()
            counts = await all_or_none(ids, lambda rid: self.calls.replica(rid).weight_ranks())
            bases = dict(zip(ids, itertools.accumulate([0, *counts.values()])))
            total = sum(counts.values())
            if group.world_size != group.trainer_ranks + total:
                raise ValueError(
                    f"world_size: {group.world_size} != the trainer's {group.trainer_ranks} + "
                    f"the {total} inference ranks ({len(ids)} replicas)"
                )
            self._groups.pop(group.group_name, None)
            rank_of = {rid: group.rank_offset + bases[rid] for rid in ids}
            _set(ready, None)
            try:
                await all_or_none(
                    ids, lambda rid: self.calls.replica(rid).join_weight_group(info, rank_of[rid])
                )
            except BaseException:
                await self._leave(ids, group.group_name)
                raise
            self._groups[group.group_name] = ids
            return {
                "group_name": group.group_name,
                "ranks": rank_of,
                "world_size": group.world_size,
            }

    async def receive_weights(
        self,
        update_id: str | None,
        group_name: str,
        spec_dicts: list[dict],
        packing: dict[str, Any] | None = None,
        detach: bool = False,
    ) -> int:
        """Receive tensors the trainer broadcasts over `group_name` into every replica of the
        update (None: the open one). Every rank checks them first: a `ValueError` changes no
        weight and leaves the update open, but the group is left (the trainer's broadcast
        for it fails at once instead of hanging; init it again). A failure while receiving
        rolls the whole update back on every replica and leaves the group.

        `detach`: return once every rank checked them, and receive in the background (TRL's
        trainer broadcasts only after its call returned); a failure is raised by the next
        call (the update rolled back)."""
        dicts = [s.to_dict() for s in manifest(spec_dicts)]
        count = await self._detachable(
            lambda ready: self._receive(update_id, group_name, dicts, packing, ready), detach
        )
        return len(dicts) if count is None else count

    async def _receive(
        self,
        update_id: str | None,
        group_name: str,
        dicts: list[dict],
        packing: dict[str, Any] | None,
        ready: asyncio.Future | None,
    ) -> int:
        async with self._lock:
            update = self._open(update_id)
            members = self._groups.get(group_name)
            if members is None:
                raise ValueError(f"group_name: no weight update group {group_name!r}; init one")
            if sorted(members) != sorted(update.replica_ids):
                raise ControlConflict("the group's replicas are not the update's: init it again")
            try:
                await all_or_none(
                    members, lambda rid: self.calls.replica(rid).check_weight_receive(dicts)
                )
            except BaseException:
                await self._leave(members, group_name)
                raise
            _set(ready, None)
            try:
                await all_or_none(
                    members,
                    lambda rid: self.calls.replica(rid).receive_weights(
                        group_name, dicts, packing or {}
                    ),
                )
            except BaseException as e:
                await self._abort_update(update, group_name)
                raise ReplicasFailed(
                    f"receiving over {group_name!r} failed, so the update was rolled back on "
                    f"every replica and the group left (init it again): {e}"
                ) from e
            update.loaded += len(dicts)
            return len(dicts)

    async def _detachable(
        self, work: Callable[[asyncio.Future | None], Coroutine[Any, Any, T]], detach: bool
    ) -> T | None:
        """`work(ready)`; detached, it runs as a task and this returns once it set `ready`
        (its checks passed; a check's error is raised here). Its later failure is kept for
        the next call that opens the update or a group (`_raise_detached_failure`)."""
        if not detach:
            return await work(None)
        ready = asyncio.get_running_loop().create_future()
        task: asyncio.Task[T] = asyncio.create_task(work(ready))
        self._detached.add(task)
        task.add_done_callback(lambda done: self._keep_failure(done, ready))
        await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            return None
        return task.result()  # a check failed (a done task's failure is raised here)

    def _keep_failure(self, task: asyncio.Task, ready: asyncio.Future) -> None:
        self._detached.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None and ready.done():  # else the caller raised it
            self._detached_failure = failure

    def _raise_detached_failure(self) -> None:
        """Raise (once) what a detached join or receive failed with since the last call."""
        failure, self._detached_failure = self._detached_failure, None
        if failure is not None:
            raise ReplicasFailed(
                f"the trainer's last weight-group call, which ran after it returned, failed "
                f"(init the group again): {failure}"
            ) from failure

    async def destroy_weight_group(self, group_name: str | None = None) -> None:
        """Every replica leaves the group (None: every group)."""
        async with self._lock:
            names = list(self._groups) if group_name is None else [group_name]
            for name in names:
                members = self._groups.pop(name, None)
                if members is not None:
                    await self._leave(members, name)

    async def abort_update(self, update_id: str | None = None) -> None:
        """Drop the update (None: the open one, if any): every replica puts back the weights
        it loaded and keeps its version; the cluster resumes if the update paused it."""
        async with self._lock:
            if self._update is not None and update_id in (None, self._update.update_id):
                await self._abort_update(self._update, None)

    async def _abort_update(self, update: Update, group_name: str | None) -> None:
        await asyncio.gather(
            *(self.calls.replica(rid).abort_weight_update() for rid in update.replica_ids),
            return_exceptions=True,
        )
        if group_name is not None:
            await self._leave(update.replica_ids, group_name)
        self._update = None
        if update.paused_here:
            await self._resume_after_commit()

    async def _leave(self, ids: list[str], group_name: str) -> None:
        """Best effort: a replica that cannot answer is not in any group any more either."""
        self._groups.pop(group_name, None)
        await asyncio.gather(
            *(self.calls.replica(rid).leave_weight_group(group_name) for rid in ids),
            return_exceptions=True,
        )


def _set(ready: asyncio.Future | None, value: Any) -> None:
    if ready is not None and not ready.done():
        ready.set_result(value)
