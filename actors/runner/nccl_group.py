"""The NCCL side of a trainer's weight-update group, as vLLM's trainer helper builds it
(`NCCLWeightTransferEngine.trainer_init`: a `StatelessProcessGroup` and a `PyNcclCommunicator`),
so TRL's and SkyRL's senders work unmodified:

1. the trainer (rank 0) hosts a TCPStore at master_address:master_port; every rank joins it;
2. rank 0 publishes NCCL's unique id under "broadcast_from/0/0", pickled as vLLM's
   `ncclUniqueId` ctypes structure (128 bytes); the others read it (unpickled only into our
   own structure of the same layout: nothing else may load);
3. every rank calls `ncclCommInitRank(world_size, id, rank)`, then a warm-up all-reduce of one
   float32 zero, as `PyNcclCommunicator` does (the trainer waits in it for every rank).

NOTE: not yet run against a GPU (none was lent to the task that wrote it).
"""

from __future__ import annotations

import ctypes
import io
import pickle
from typing import Any

import torch
from raylane.actors.runner.group_info import JOIN_TIMEOUT, GroupInfo

_NCCL_TYPES = {
    torch.uint8: 1,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_SUM = 0


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class _IdUnpickler(pickle.Unpickler):
    """Loads vLLM's pickled `ncclUniqueId` into ours; refuses every other class."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return super().find_class(module, name)
        if name == "ncclUniqueId" and module.endswith("pynccl_wrapper"):
            return NcclUniqueId
        raise pickle.UnpicklingError(f"weight group: {module}.{name} may not load here")


class NcclGroup:
    def __init__(self, info: GroupInfo, rank: int, device: torch.device) -> None:
        from torch.distributed import TCPStore

        self.device = device
        self._lib = _load_nccl()
        store = TCPStore(
            info.master_address, info.master_port, info.world_size, False, JOIN_TIMEOUT,
            use_libuv=False,
        )  # fmt: skip
        unique_id = read_unique_id(store.get("broadcast_from/0/0"))
        self._comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(
                self._lib.ncclCommInitRank(
                    ctypes.byref(self._comm), info.world_size, unique_id, rank
                )
            )
            warmup = torch.zeros(1, device=device)
            self._collective("ncclAllReduce", warmup, _SUM)
            torch.cuda.current_stream(device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._collective("ncclBroadcast", tensor, 0)  # root 0: the trainer
        torch.cuda.current_stream(self.device).synchronize()

    def _collective(self, name: str, tensor: torch.Tensor, arg: int) -> None:
        # ncclAllReduce(send, recv, count, type, op, comm, stream);
        # ncclBroadcast(send, recv, count, type, root, comm, stream): in place on receivers
        ptr = ctypes.c_void_p(tensor.data_ptr())
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        count = ctypes.c_size_t(tensor.numel())
        _check(
            getattr(self._lib, name)(
                ptr, ptr, count, _NCCL_TYPES[tensor.dtype], arg, self._comm, stream
            )
        )

    def close(self) -> None:
        if self._comm:
            self._lib.ncclCommAbort(self._comm)  # a peer stuck with us fails at once
            self._comm = ctypes.c_void_p()


def _load_nccl() -> ctypes.CDLL:
    """The NCCL library torch was built with (its nvidia wheel), else the system's."""
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("nvidia.nccl")
    for base in spec.submodule_search_locations or [] if spec else []:
        for path in glob.glob(os.path.join(base, "lib", "libnccl.so*")):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libnccl.so.2")


def read_unique_id(data: bytes) -> NcclUniqueId:
    """vLLM's pickled `ncclUniqueId` (what rank 0 publishes) as our structure."""
    return _IdUnpickler(io.BytesIO(data)).load()


def _check(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"NCCL error {result}")
