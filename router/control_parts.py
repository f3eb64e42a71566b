"""The control plane's parts: how it reaches replicas (`ReplicaCalls`, `ReplicaTable`), the
update in progress, and the checks on what a caller asks for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raylane.actors.models.weights import TensorSpec


class ReplicaCalls(Protocol):
    """Calls one engine replica's control methods (those of `raylane.actors.replica.EngineReplica`).
    Each raises what the replica raised: `ValueError` for bad input; anything else means the
    replica failed."""

    async def pause(self, replica_id: str, mode: str) -> None: ...

    async def resume(self, replica_id: str) -> None: ...

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict] | None) -> None: ...

    async def load_weight_bucket(self, replica_id: str, bucket: Any) -> int: ...

    async def finish_weight_update(self, replica_id: str, version: int) -> int: ...

    async def abort(self, replica_id: str, request_ids: list[str] | None) -> list: ...

    async def flush_cache(self, replica_id: str) -> None: ...

    async def call(self, replica_id: str, method: str, *args: Any) -> Any:
        """One of `raylane.actors.engine.upkeep.CONTROL_CALLS` on the replica's engine."""
        ...

    # the trainer's collective group (`raylane.actors.engine.weight_transfer`)

    async def weight_ranks(self, replica_id: str) -> int: ...

    async def join_weight_group(self, replica_id: str, info: dict, rank_base: int) -> int: ...

    async def check_weight_receive(self, replica_id: str, spec_dicts: list[dict]) -> None: ...

    async def receive_weights(
        self, replica_id: str, group_name: str, spec_dicts: list[dict], packing: dict
    ) -> int: ...

    async def abort_weight_update(self, replica_id: str) -> None: ...

    async def leave_weight_group(self, replica_id: str, group_name: str | None) -> None: ...


class ReplicaTable(Protocol):
    """The replicas a control call reaches, and their weight versions."""

    def reachable(self) -> list[str]:
        """The ids of the healthy replicas."""
        ...

    def weight_version(self) -> int:
        """The cluster's version: the highest any replica reports."""
        ...

    def set_version(self, replica_id: str, version: int) -> None: ...

    def report_failure(self, replica_id: str) -> None:
        """A control call failed on this replica: stop routing to it until it recovers."""
        ...


@dataclass
class Update:
    """A weight update in progress: where it goes and what it has loaded so far."""

    update_id: str
    version: int | None  # None: the commit says (or the next)
    replica_ids: list[str]
    num_tensors: int  # in the manifest (None when open-ended: each receive brings its own)
    paused_here: bool  # the update paused the cluster, so its commit resumes it
    loaded: int = 0  # tensors applied so far (on every replica of the update)
    failed: list[str] = field(default_factory=list)  # replicas that left the update


def manifest(spec_dicts: list[dict]) -> list[TensorSpec]:
    """The update's tensors, checked for form (names and shapes are checked by the replicas)."""
    if not isinstance(spec_dicts, list) or not spec_dicts:
        raise ValueError("tensors: give a non-empty list of {'name', 'shape', 'dtype'}")
    specs = [TensorSpec.from_dict(d) for d in spec_dicts]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensors: {twice[:3]} appear more than once")
    return specs


def commit_version(update: Update, version: int | None, current: int) -> int:
    version = update.version if version is None else version
    if version is None:
        return current + 1
    check_version(version, current)
    return version


def check_version(version: int, current: int) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"version: must be an integer, got {version!r}")
    if version <= current:
        raise ValueError(f"version: {version} is not newer than the cluster's {current}")


async def all_or_none(ids: list[str], call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
    """`call` on every replica at once; all must succeed (a `ValueError` first, else the first
    error, raises). Unlike `ControlPlane._everywhere` no replica is reported failed: a trainer
    that never came, or left, fails every rank at once."""
    results = await asyncio.gather(*(call(rid) for rid in ids), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, ValueError)), errors[0])
    return dict(zip(ids, results))
