"""Where a trainer's weight-update group is and who is in it (torch-free: the control plane
checks it before any rank joins)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

GROUP_BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP_NAME = "weight_update_group"
GROUP_TIMEOUT = datetime.timedelta(seconds=300)  # a broadcast waits this long for the trainer
# joining waits this long for the trainer's store and peers: the replica's event loop waits
# with it (trainers start their side together with the init call, so it takes seconds)
JOIN_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class GroupInfo:
    """Where the trainer's group is and who is in it (`rank_offset`: the first inference rank;
    `world_size`: the trainer's ranks and every inference rank).

    `trainer_last`: TRL's `trl vllm-serve` scheme, in which the trainer is the last rank
    (`world_size - 1`), the inference ranks start at 0, inference rank 0 hosts the store, and
    every broadcast is followed by a barrier. Otherwise the trainer is rank 0 (SGLang's and
    vLLM's scheme) and hosts the store."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    trainer_last: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address: give the trainer's host name or address")
        for name in ("master_port", "rank_offset", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: {self.master_port} is not a TCP port")
        if self.trainer_last and self.rank_offset != 0:
            raise ValueError(
                "rank_offset: the trainer is the last rank, so inference ranks start at 0"
            )
        if not self.trainer_last and self.rank_offset < 1:
            raise ValueError("rank_offset: the trainer is rank 0, so inference ranks start at 1")
        if self.trainer_last and self.backend != "gloo":
            raise ValueError(
                "backend: TRL's former communicator (the trainer the last rank) is served over "
                "gloo only; TRL >= 1.16 syncs over NCCL through vLLM's weight-transfer routes"
            )
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError("group_name: give a non-empty name")
        if self.backend not in GROUP_BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one of {list(GROUP_BACKENDS)}")

    @property
    def source_rank(self) -> int:
        """The trainer's rank, from which every broadcast comes."""
        return self.world_size - 1 if self.trainer_last else 0

    @property
    def trainer_ranks(self) -> int:
        """The ranks that are not inference ranks."""
        return 1 if self.trainer_last else self.rank_offset

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
