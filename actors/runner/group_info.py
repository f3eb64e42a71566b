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
    `world_size`: the trainer's ranks and every inference rank)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address: give the trainer's host name or address")
        for name in ("master_port", "rank_offset", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: {self.master_port} is not a TCP port")
        if self.rank_offset < 1:
            raise ValueError("rank_offset: the trainer is rank 0, so inference ranks start at 1")
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError("group_name: give a non-empty name")
        if self.backend not in GROUP_BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one of {list(GROUP_BACKENDS)}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
