"""A trainer process for the NCCL weight-transfer check: rank 0 of the weight-update group on
its own GPU, built as vLLM's trainer helper builds it (`StatelessProcessGroup.create` +
`PyNcclCommunicator`) when vLLM imports, else by an implementation of that helper's wire of
our own, written apart from raylane's receiving side (actors/runner/nccl_group.py):

1. host a TCPStore at the master address (vLLM's StatelessProcessGroup, rank 0);
2. `ncclGetUniqueId`, published pickled under "broadcast_from/0/0" as vLLM's ctypes
   `ncclUniqueId` (a class of a module named `...pynccl_wrapper`), as `broadcast_obj` does;
3. `ncclCommInitRank(world_size, id, 0)`, then the warm-up all-reduce of one float32 zero.

    python -m tests.gpu.nccl_trainer '{"port", "world_size", "device", "file", "names",
                                       "packed", "buffer", "side": "vllm" | "ctypes"}'

Prints "joined" once in the group, then broadcasts the tensors (vLLM's packed chunks when
`packed`) once per line read on stdin, printing "sent" after each round.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import importlib.util
import json
import os
import pickle
import sys
import types
from collections.abc import Callable

import torch
from safetensors.torch import load_file

from tests.weight_trainer import chunks

NCCL_DTYPES = {torch.uint8: 1, torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}
PEER_MODULE = "trainer_side.pynccl_wrapper"  # vLLM's is vllm...pynccl_wrapper


class ncclUniqueId(ctypes.Structure):  # noqa: N801 (vLLM's name, which the pickle carries)
    _fields_ = [("internal", ctypes.c_byte * 128)]


def vllm_side(port: int, world_size: int, device: torch.device) -> Callable:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=world_size)
    comm = PyNcclCommunicator(group, device=device)
    return lambda t: comm.broadcast(t, src=0, stream=torch.cuda.current_stream(device))


def ctypes_side(port: int, world_size: int, device: torch.device) -> Callable:
    return CtypesSender(port, world_size, device)


class CtypesSender:
    """vLLM's trainer side, written from its wire: the store, the pickled id, the comm."""

    def __init__(self, port: int, world_size: int, device: torch.device) -> None:
        from torch.distributed import TCPStore

        self.device = device
        timeout = datetime.timedelta(seconds=300)
        # the master: kept for the group's life (the receivers hold connections to it)
        self.store = TCPStore("127.0.0.1", port, world_size, True, timeout, use_libuv=False)
        self.lib = _libnccl()
        unique_id = ncclUniqueId()
        _ok(self.lib.ncclGetUniqueId(ctypes.byref(unique_id)))
        self.store.set("broadcast_from/0/0", published(unique_id))
        self.comm = ctypes.c_void_p()
        self.lib.ncclCommInitRank.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ncclUniqueId, ctypes.c_int,
        ]  # fmt: skip
        with torch.cuda.device(device):
            _ok(self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, unique_id, 0))
        self._collective("ncclAllReduce", torch.zeros(1, device=device), 0)  # ncclSum warm-up
        torch.cuda.current_stream(device).synchronize()

    def __call__(self, tensor: torch.Tensor) -> None:
        self._collective("ncclBroadcast", tensor, 0)  # root 0: the trainer

    def _collective(self, name: str, t: torch.Tensor, arg: int) -> None:
        # ncclAllReduce / ncclBroadcast(send, recv, count, dtype, op | root, comm, stream)
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        ptr, count = ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel())
        fn = getattr(self.lib, name)
        _ok(fn(ptr, ptr, count, NCCL_DTYPES[t.dtype], arg, self.comm, stream))


def published(unique_id: ncclUniqueId) -> bytes:
    """The id as vLLM's `broadcast_obj` stores it: pickled, its class under vLLM's names."""
    if PEER_MODULE not in sys.modules:  # a package and its module, so pickle finds the class
        package, _, name = PEER_MODULE.rpartition(".")
        module = types.ModuleType(PEER_MODULE)
        module.ncclUniqueId = ncclUniqueId  # type: ignore[attr-defined]
        ncclUniqueId.__module__ = PEER_MODULE
        sys.modules[package] = types.ModuleType(package)
        setattr(sys.modules[package], name, module)
        sys.modules[PEER_MODULE] = module
    return pickle.dumps(unique_id)


def _libnccl() -> ctypes.CDLL:
    spec = importlib.util.find_spec("nvidia.nccl")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for path in glob.glob(os.path.join(base, "lib", "libnccl.so*")):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libnccl.so.2")


def _ok(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"NCCL error {result}")


def main() -> None:
    plan = json.loads(sys.argv[1])
    device = torch.device(plan["device"])
    torch.cuda.set_device(device)
    side = vllm_side if plan["side"] == "vllm" else ctypes_side
    send = side(plan["port"], plan["world_size"], device)
    print("joined", flush=True)
    weights = load_file(plan["file"], device=str(device))
    tensors = [weights[name] for name in plan["names"]]
    for _ in sys.stdin:  # one update per line
        for t in chunks(tensors, plan.get("packed", False), plan.get("buffer", 1)):
            send(t)
        torch.cuda.synchronize(device)
        print("sent", flush=True)
    os._exit(0)  # NOTE: no NCCL teardown: the receivers may already have aborted theirs


if __name__ == "__main__":
    main()
