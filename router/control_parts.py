"""The control plane's parts: how it reaches replicas (`ReplicaCalls`, `ReplicaTable`), the
update in progress, and the checks on what a caller asks for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raylane.actors.models.weights import TensorSpec
from raylane.actors.replica_control import ReplicaControl

LABELS_KEPT = 1024  # the newest versions whose labels the control plane remembers


class ReplicaCalls(Protocol):
    """Reaches the engine replicas: `replica(id)` has that replica's control methods (those of
    `raylane.actors.replica_control.ReplicaControl`). Each raises what the replica raised:
    `ValueError` for bad input; anything else means the replica failed (a replica that is
    gone too, when its call is awaited)."""

    def replica(self, replica_id: str) -> ReplicaControl: ...


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
    label: str | None = None  # a trainer protocol's name for the version (None: the integer)
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


def check_label(label: str | None) -> None:
    if label is not None and not isinstance(label, str):
        raise ValueError(f"label: must be a string, got {label!r}")


def remember_label(labels: dict[int, str], version: int, label: str) -> None:
    """Keep `label` for `version`, and only the newest `LABELS_KEPT` (outputs older than those
    are far past any `max_weight_lag`; their versions then read as the integer)."""
    labels[version] = label
    while len(labels) > LABELS_KEPT:
        del labels[next(iter(labels))]


def check_version(version: int, current: int) -> None:
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"version: must be an integer, got {version!r}")
    if version <= current:
        raise ValueError(f"version: {version} is not newer than the cluster's {current}")


async def all_or_none(ids: list[str], call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
    """`call` on every replica at once; all must succeed (a `ValueError` first, else the first
    error, raises). Unlike `ReplicaBroadcast._everywhere` no replica is reported failed: a trainer
    that never came, or left, fails every rank at once."""
    results = await asyncio.gather(*(call(rid) for rid in ids), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, ValueError)), errors[0])
    return dict(zip(ids, results))
