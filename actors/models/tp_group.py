"""`TPGroup`: this process's place in its tensor-parallel group, and the collectives the layers
call through it (timed by its `CollectiveClock` for the step split)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CollectiveClock:
    """Seconds spent waiting in collectives (on CPU they are synchronous), for the step split.
    On GPU this counts launch time only: NCCL runs asynchronously."""

    seconds: float = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when world_size > 1
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        torch.distributed.all_reduce(x, group=self.group)
        self.clock.seconds += time.perf_counter() - start
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        start = time.perf_counter()
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        self.clock.seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)
