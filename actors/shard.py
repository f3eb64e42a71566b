"""ModelShard: one tensor-parallel rank of a model, a ModelRunner inside a Ray actor.

A shard group is `tensor_parallel_size` of these, placed on one node by the Ray executor's
placement group; they form a `torch.distributed` group (gloo on CPU, NCCL on GPU) whose
rendezvous is on loopback at a port rank 0 picks when the group starts. A group never spans
nodes, so loopback always reaches every rank. Operators find the ranks as `ModelShard` in
`ray list actors`.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from actors.runner.config import RunnerConfig, RunnerInfo
from actors.runner.plan import StepPlan, StepResult

LOOPBACK = "127.0.0.1"
# a collective waits this long for a peer before failing (a dead peer usually fails it at once)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class ModelShard:
    """One rank. Constructed cheaply; `start` joins the process group and loads the slice."""

    def __init__(self, config: RunnerConfig, rank: int, world_size: int, torch_threads: int):
        import torch

        self.config, self.rank, self.world_size = config, rank, world_size
        torch.set_num_threads(torch_threads)
        self.runner = None

    def pick_port(self) -> int:
        """A free loopback port on this node for the group's rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]

    def start(self, port: int) -> RunnerInfo:
        """Join the process group (every rank must call this together), then load the slice."""
        import torch
        import torch.distributed as dist

        from actors.models import TPGroup
        from actors.runner.model_runner import ModelRunner, resolve_device

        device = resolve_device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{LOOPBACK}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)
        self.runner = ModelRunner(self.config, tp)
        return self.runner.info()

    def execute(self, plan: StepPlan) -> StepResult | None:
        return self.runner.execute(plan)

    def rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a ModelRunner method on this rank (the executor's `collective_rpc`)."""
        return getattr(self.runner, method)(*args, **kwargs)

    def ping(self) -> int:
        return self.rank

    def stop(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
