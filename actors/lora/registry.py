"""`LoRARegistry`: the engine's adapters, their versions and the `max_loras` slots.

Torch-free bookkeeping (the tensors are opaque here). A request binds, at admission, to one
version of its adapter (the newest unless it names one) and keeps that binding, and so that
version's slot, to its end. A version no live request uses and that is not its adapter's
newest is gone (LoRAVersionGone). Slots are handed out least recently used first, over the
versions no live request holds, pinned adapters' newest versions excepted.

What runs on the runners comes in as callbacks: `check(weights)` (every rank: would it load?)
and `load(slot, weights)` (every rank, between steps).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from raylane.actors.lora.errors import LoRAInUse, LoRANotFound, LoRASlotsFull, LoRAVersionGone
from raylane.actors.lora.request import LoRARequest

VersionKey = tuple[str, int]  # (adapter name, version)
Versions = list[int]  # (spelled here: `LoRARegistry.list` shadows the builtin in the class)


@dataclass(frozen=True)
class LoRABinding:
    """What a request runs on: an adapter version and the slot that holds it."""

    name: str
    version: int
    slot: int

    @property
    def key(self) -> VersionKey:
        return (self.name, self.version)


@dataclass(frozen=True)
class LoRAInfo:
    name: str
    int_id: int
    path: str
    version: int
    version_label: str | int | None
    rank: int
    pinned: bool
    loaded: bool  # the newest version sits in a slot


@dataclass
class _Version:
    weights: Any  # LoRAWeights
    label: str | int | None = None


@dataclass
class _Adapter:
    int_id: int
    path: str
    versions: dict[int, _Version] = field(default_factory=dict)
    pinned: bool = False
    removing: bool = False  # removed while requests ran: gone once they end

    @property
    def newest(self) -> int:
        return max(self.versions)


class LoRARegistry:
    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        check: Callable[[Any], None],
        load: Callable[[int, Any], None],
        live: Callable[[], Iterable[LoRABinding]],
    ) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._check, self._load, self._live = check, load, live
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()  # least recently used first
        self._slots: dict[int, VersionKey] = {}  # slot (1..max_loras) -> version it holds
        self._slot_lru: OrderedDict[int, None] = OrderedDict()

    # --- adapters -----------------------------------------------------------------------------

    def add(self, request: LoRARequest, weights: Any, pinned: bool = False) -> bool:
        """Register an adapter, or a new version of a registered name (a new path). False
        when that name and path are already registered (nothing changes)."""
        self._sweep()
        old = self._adapters.get(request.lora_name)
        if old is not None and old.path == request.lora_path and not old.removing:
            return False
        if pinned and (old is None or not old.pinned) and self._num_pinned() >= self.max_loras:
            raise LoRASlotsFull(f"pinned: all {self.max_loras} slots hold pinned adapters")
        self._check(weights)
        if old is None:
            self._make_room()
            entry = _Adapter(request.lora_int_id, request.lora_path, {1: _Version(weights)})
            self._adapters[request.lora_name] = entry
        else:  # a new version (numbers go on past a removed one whose requests still run)
            old.path, old.int_id, old.removing = request.lora_path, request.lora_int_id, False
            old.versions[old.newest + 1] = _Version(weights)
        self._adapters[request.lora_name].pinned |= pinned
        self._adapters.move_to_end(request.lora_name)
        if pinned:
            self._slot_of((request.lora_name, self._adapters[request.lora_name].newest))
        return True

    def add_version(self, name: str, weights: Any, version: int | str | None) -> int:
        """A new version of `name` (update_lora): an int must be newer than the newest; a str
        is a label, the number is the next one. Returns the number."""
        self._sweep()
        entry = self._entry(name)
        number, label = entry.newest + 1, version
        if isinstance(version, int) and not isinstance(version, bool):
            if version <= entry.newest:
                raise ValueError(f"version: {version} is not newer than {entry.newest}")
            number = version
        elif version is not None and not isinstance(version, str):
            raise ValueError(f"version: must be an int, a str or None, got {version!r}")
        self._check(weights)
        entry.versions[number] = _Version(weights, label)
        self._sweep()
        if entry.pinned:
            self._slot_of((name, number))
        return number

    def weights(self, name: str) -> Any:
        """The newest version's weights (what an update starts from)."""
        return self._entry(name).versions[self._entry(name).newest].weights

    def remove(self, name: str, wait: bool = True) -> bool:
        self._sweep()
        entry = self._adapters.get(name)
        if entry is None or entry.removing:
            return False
        busy = any(b.name == name for b in self._live())
        if busy and not wait:
            raise LoRAInUse(f"lora_name {name!r}: requests in flight run on it")
        entry.removing = True  # new requests see it gone; dropped once its requests end
        self._sweep()
        return True

    def pin(self, name: str) -> bool:
        self._sweep()
        entry = self._entry(name)
        if not entry.pinned:
            if self._num_pinned() >= self.max_loras:
                raise LoRASlotsFull(f"pinned: all {self.max_loras} slots hold pinned adapters")
            self._slot_of((name, entry.newest))
            entry.pinned = True
        return True

    def list(self) -> list[LoRAInfo]:
        self._sweep()
        held = set(self._slots.values())
        return [
            LoRAInfo(
                name,
                e.int_id,
                e.path,
                e.newest,
                e.versions[e.newest].label,
                e.versions[e.newest].weights.rank,
                e.pinned,
                (name, e.newest) in held,
            )
            for name, e in sorted(self._adapters.items())
            if not e.removing
        ]

    def held_versions(self) -> dict[str, Versions]:
        """Per adapter, the versions a new request may still bind: its newest, and those live
        requests run on (what the Router routes a request that names a version by)."""
        self._sweep()
        return {name: sorted(e.versions) for name, e in self._adapters.items() if not e.removing}

    def has(self, name: str) -> bool:
        entry = self._adapters.get(name)
        return entry is not None and not entry.removing

    # --- requests -----------------------------------------------------------------------------

    def bind(self, request: LoRARequest) -> LoRABinding:
        """The version (and slot) a new request runs on; loads it into a slot if needed."""
        self._sweep()
        entry = self._entry(request.lora_name)
        version = entry.newest if request.version is None else request.version
        if version not in entry.versions:
            raise LoRAVersionGone(
                f"lora_name {request.lora_name!r}: version {version} is no longer held "
                f"(the newest is {entry.newest})"
            )
        self._adapters.move_to_end(request.lora_name)
        return LoRABinding(request.lora_name, version, self._slot_of((request.lora_name, version)))

    def _entry(self, name: str) -> _Adapter:
        entry = self._adapters.get(name)
        if entry is None or entry.removing:
            raise LoRANotFound(f"lora_name {name!r}: no adapter of that name is loaded")
        return entry

    # --- slots --------------------------------------------------------------------------------

    def _slot_of(self, key: VersionKey) -> int:
        for slot, held in self._slots.items():
            if held == key:
                self._slot_lru.move_to_end(slot)
                return slot
        slot = self._free_slot()
        self._load(slot, self._adapters[key[0]].versions[key[1]].weights)
        self._slots[slot] = key
        self._slot_lru[slot] = None
        self._slot_lru.move_to_end(slot)
        return slot

    def _free_slot(self) -> int:
        free = [s for s in range(1, self.max_loras + 1) if s not in self._slots]
        if free:
            return free[0]
        busy = {b.key for b in self._live()}
        for slot in self._slot_lru:  # least recently used first
            key = self._slots[slot]
            entry = self._adapters.get(key[0])
            pinned = entry is not None and entry.pinned and key[1] == entry.newest
            if key not in busy and not pinned:
                del self._slots[slot], self._slot_lru[slot]
                return slot
        raise LoRASlotsFull(
            f"max_loras: all {self.max_loras} slots hold pinned adapters or adapters that "
            "requests in flight run on"
        )

    def slots_will_free(self) -> bool:
        """Some slot holds a version that is not pinned: it frees once its requests end."""
        for key in self._slots.values():
            entry = self._adapters.get(key[0])
            if entry is None or not entry.pinned or key[1] != entry.newest:
                return True
        return len(self._slots) < self.max_loras

    def _num_pinned(self) -> int:
        return sum(1 for e in self._adapters.values() if e.pinned and not e.removing)

    def _make_room(self) -> None:
        """Before registering a new name: at most max_cpu_loras names, the least recently
        used unpinned one without live requests dropped (while every one is pinned or in use,
        the new one is held beyond the bound, as a request that names a path must run)."""
        live = [e for e in self._adapters.values() if not e.removing]
        if len(live) < self.max_cpu_loras:
            return
        busy = {b.name for b in self._live()}
        for name, entry in self._adapters.items():
            if not entry.pinned and not entry.removing and name not in busy:
                entry.removing = True
                self._sweep()
                return

    def _sweep(self) -> None:
        """Drop what no live request holds: old versions, and removed adapters."""
        busy = {b.key for b in self._live()}
        for name, entry in list(self._adapters.items()):
            for version in list(entry.versions):
                keep = version == entry.newest and not entry.removing
                if not keep and (name, version) not in busy:
                    del entry.versions[version]
                    self._free_slot_of((name, version))
            if not entry.versions:
                del self._adapters[name]

    def _free_slot_of(self, key: VersionKey) -> None:
        for slot, held in list(self._slots.items()):
            if held == key:
                del self._slots[slot], self._slot_lru[slot]
