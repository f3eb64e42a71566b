"""Executors run step plans on model runners: in this process ("uni") or on a group of Ray
`ModelShard` actors, one per tensor-parallel rank ("ray"). The engine knows only `Executor`.
"""

from __future__ import annotations

from raylane.actors.executor.base import Executor, ExecutorError
from raylane.actors.runner.config import RunnerConfig

BACKENDS = ("uni", "ray")


def create_executor(
    config: RunnerConfig, backend: str, shard_resources: dict[str, float] | None = None
) -> Executor:
    """Start the runners of `config` on `backend` ("uni" or "ray"); blocks until they are ready.

    `shard_resources`: the Ray resources of each rank's bundle (Ray executor only)."""
    # NOTE: imported here so the engine core stays free of torch and Ray until it starts one
    if backend == "uni":
        from raylane.actors.executor.uni import UniExecutor

        return UniExecutor(config)
    if backend == "ray":
        from raylane.actors.executor.ray_executor import RayExecutor

        return RayExecutor(config, shard_resources)
    raise ValueError(f"distributed_executor_backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["BACKENDS", "Executor", "ExecutorError", "create_executor"]
