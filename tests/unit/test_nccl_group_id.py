"""The NCCL weight group's id exchange, without a GPU: rank 0 of vLLM's trainer helper publishes
its `ncclUniqueId` ctypes structure pickled; we load it into our own structure, and nothing else
(the rest of the NCCL path needs a GPU, see actors/runner/nccl_group.py)."""

from __future__ import annotations

import ctypes
import pickle
import sys
import types

import pytest
from raylane.actors.runner.nccl_group import read_unique_id

PEER_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"


def test_vllms_pickled_unique_id_loads_into_our_structure_and_nothing_else(monkeypatch):
    module = types.ModuleType(PEER_MODULE)

    class ncclUniqueId(ctypes.Structure):  # noqa: N801 (the peer's name, as vLLM spells it)
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__ = PEER_MODULE
    ncclUniqueId.__qualname__ = "ncclUniqueId"
    module.ncclUniqueId = ncclUniqueId
    parts = PEER_MODULE.split(".")
    for i in range(1, len(parts)):  # the peer's packages, empty, so pickle finds the class
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
    monkeypatch.setitem(sys.modules, PEER_MODULE, module)
    theirs = ncclUniqueId()
    for i in range(128):
        theirs.internal[i] = (7 * i) % 256 - 128
    ours = read_unique_id(pickle.dumps(theirs))
    assert type(ours) is not ncclUniqueId and bytes(ours) == bytes(theirs)
    with pytest.raises(pickle.UnpicklingError):
        read_unique_id(pickle.dumps(types.SimpleNamespace(a=1)))
