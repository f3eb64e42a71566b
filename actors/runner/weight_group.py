"""A collective group through which a trainer broadcasts weights to the inference ranks.

The trainer is rank 0; every rank of every engine replica joins as `rank_offset + its global
index`. The group is its own world, built from its own store: it never touches the shards'
tensor-parallel group (the default `torch.distributed` group in a shard).

gloo (CPU): SGLang's scheme, which its trainers (slime, AReaL) build with
`init_custom_process_group`: a TCPStore at `tcp://master_address:master_port` hosted by the
trainer, the keys under `group_name`, then `{group_name}/`, then `{device}/` for the first device
torch maps the gloo backend to ("cpu": torch's helper makes one context when every device maps
to the same backend).

TRL's `trl vllm-serve` scheme (`GroupInfo.trainer_last`), on gloo: the same keys, but the trainer
is the last rank, inference rank 0 hosts the store, and each broadcast ends in a barrier (TRL's
trainer waits in one after every tensor).

nccl (GPU): vLLM's scheme (`StatelessProcessGroup` + `PyNcclCommunicator`), see nccl_group.py.
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING, Protocol

from raylane.actors.runner.group_info import GROUP_TIMEOUT, JOIN_TIMEOUT, GroupInfo

if TYPE_CHECKING:
    import torch


class WeightGroup(Protocol):
    """One rank's membership: receive a broadcast from the trainer (rank 0) into `tensor`."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class GlooGroup:
    def __init__(self, info: GroupInfo, rank: int, timeout: datetime.timedelta = GROUP_TIMEOUT):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
        from torch.distributed.distributed_c10d import Backend, BackendConfig

        self.rank, self.source, self.barrier = rank, info.source_rank, info.trainer_last
        # rank 0 (the trainer; TRL's scheme: the first inference rank) hosts the store
        self._store = TCPStore(
            info.master_address,
            info.master_port,
            info.world_size,
            rank == 0,
            JOIN_TIMEOUT,
        )
        group_store = PrefixStore(f"{info.group_name}/", PrefixStore(info.group_name, self._store))
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname=_local_address(info))]
        # NOTE: the key prefix must be the trainer's to the byte, or both sides wait forever
        device = next(iter(BackendConfig(Backend("gloo")).get_device_backend_map()))
        self._context = ProcessGroupGloo(
            PrefixStore(f"{device}/", group_store), rank, info.world_size, options
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """The trainer sends `tensor`; every other rank receives into its own."""
        from torch.distributed import BarrierOptions, BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.source, 0
        self._context.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]
        if self.barrier:
            self._context.barrier(BarrierOptions()).wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        try:
            self._context.abort()  # a peer stuck in a broadcast with us fails at once
        except RuntimeError:
            pass


def join_group(info: GroupInfo, rank: int, device: torch.device) -> WeightGroup:
    """Join the trainer's group as `rank` (blocks until every rank has joined)."""
    if info.backend == "nccl":
        if device.type != "cuda":
            raise ValueError("backend: 'nccl' needs the engine on a GPU; use 'gloo' on the CPU")
        from raylane.actors.runner.nccl_group import NcclGroup

        return NcclGroup(info, rank, device)
    if device.type != "cpu":
        raise ValueError("backend: 'gloo' receives into CPU memory; use 'nccl' on a GPU")
    return GlooGroup(info, rank)


def _local_address(info: GroupInfo) -> str:
    """This host's address on the route to the trainer (gloo binds there: the shards' own
    GLOO_SOCKET_IFNAME is loopback, which a trainer on another node cannot reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((info.master_address, info.master_port))  # UDP: nothing is sent
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()
