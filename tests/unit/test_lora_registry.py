"""The engine's adapter bookkeeping (torch-free): versions, the max_loras slots (least
recently used first, pinned and in-use versions kept), and its errors. The runners are
stood in for by the registry's injected load and check callbacks, which record calls."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from raylane.actors.lora import (
    LoRABinding,
    LoRAInUse,
    LoRANotFound,
    LoRARegistry,
    LoRARequest,
    LoRASlotsFull,
    LoRAVersionGone,
)


@dataclass
class W:
    rank: int = 4
    bad: bool = False


class Runners:
    def __init__(self) -> None:
        self.slots: dict[int, W] = {}
        self.live: list[LoRABinding] = []

    def check(self, weights: W) -> None:
        if weights.bad:
            raise ValueError("target_modules: no such module")

    def load(self, slot: int, weights: W) -> None:
        self.slots[slot] = weights


def _registry(max_loras: int = 2, max_cpu: int = 3) -> tuple[LoRARegistry, Runners]:
    runners = Runners()
    return LoRARegistry(
        max_loras, max_cpu, runners.check, runners.load, lambda: runners.live
    ), runners


def test_slots_lru_and_in_use() -> None:
    reg, run = _registry()
    wa, wb, wc = W(), W(), W()
    reg.add(LoRARequest("a", 1, "/a"), wa)
    reg.add(LoRARequest("b", 2, "/b"), wb)
    reg.add(LoRARequest("c", 3, "/c"), wc)
    a = reg.bind(LoRARequest("a", 1))
    b = reg.bind(LoRARequest("b", 2))
    assert {a.slot, b.slot} == {1, 2} and run.slots[a.slot] is wa
    run.live = [a, b]
    with pytest.raises(LoRASlotsFull):  # both slots serve requests in flight
        reg.bind(LoRARequest("c", 3))
    run.live = [b]
    c = reg.bind(LoRARequest("c", 3))  # a's slot was free of requests: taken
    assert c.slot == a.slot and run.slots[c.slot] is wc
    assert reg.bind(LoRARequest("b", 2)) == b  # already held: no load


def test_versions_and_gone() -> None:
    reg, run = _registry()
    v1, v2 = W(), W()
    reg.add(LoRARequest("a", 1, "/a1"), v1)
    first = reg.bind(LoRARequest("a", 1))
    run.live = [first]
    assert reg.add(LoRARequest("a", 1, "/a2"), v2)  # a new path: version 2
    assert not reg.add(LoRARequest("a", 1, "/a2"), v2)  # the same again: nothing changes
    second = reg.bind(LoRARequest("a", 1))
    assert (first.version, second.version) == (1, 2) and first.slot != second.slot
    assert reg.bind(LoRARequest("a", 1, version=1)) == first  # still running: held
    run.live = []
    with pytest.raises(LoRAVersionGone):
        reg.bind(LoRARequest("a", 1, version=1))
    assert [(i.name, i.version) for i in reg.list()] == [("a", 2)]
    assert reg.add_version("a", W(), "step-7") == 3
    assert reg.list()[0].version_label == "step-7"
    with pytest.raises(ValueError, match="not newer"):
        reg.add_version("a", W(), 2)
    assert reg.add_version("a", W(), 10) == 10


def test_pinned_and_remove() -> None:
    reg, run = _registry(max_loras=1)
    reg.add(LoRARequest("a", 1, "/a"), W(), pinned=True)
    assert reg.list()[0].loaded and reg.list()[0].pinned
    reg.add(LoRARequest("b", 2, "/b"), W())
    with pytest.raises(LoRASlotsFull):  # the one slot is pinned
        reg.bind(LoRARequest("b", 2))
    with pytest.raises(LoRASlotsFull):
        reg.pin("b")
    with pytest.raises(LoRASlotsFull):
        reg.add(LoRARequest("c", 3, "/c"), W(), pinned=True)
    assert [i.name for i in reg.list()] == ["a", "b"]  # nothing added
    run.live = [reg.bind(LoRARequest("a", 1))]
    with pytest.raises(LoRAInUse):
        reg.remove("a", wait=False)
    assert reg.remove("a", wait=True)  # gone for new requests, its requests run on
    with pytest.raises(LoRANotFound):
        reg.bind(LoRARequest("a", 1))
    run.live = []
    assert [i.name for i in reg.list()] == ["b"]
    assert reg.bind(LoRARequest("b", 2)).slot == 1  # the slot came back


def test_bad_weights_change_nothing_and_cpu_limit() -> None:
    reg, run = _registry(max_loras=1, max_cpu=2)
    with pytest.raises(ValueError, match="target_modules"):
        reg.add(LoRARequest("a", 1, "/a"), W(bad=True))
    assert reg.list() == [] and run.slots == {}
    reg.add(LoRARequest("a", 1, "/a"), W())
    reg.add(LoRARequest("b", 2, "/b"), W())
    run.live = [reg.bind(LoRARequest("a", 1))]
    reg.add(LoRARequest("c", 3, "/c"), W())  # b, least recently used and idle, makes room
    assert [i.name for i in reg.list()] == ["a", "c"]
    with pytest.raises(LoRANotFound):
        reg.bind(LoRARequest("b", 2))
