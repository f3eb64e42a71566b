"""The executor protocol: the engine's only view of where and how the model runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from actors.runner.config import RunnerInfo
from actors.runner.plan import StepPlan, StepResult


class ExecutorError(RuntimeError):
    """A step (or a call to every rank) failed on the runners; the executor may be unusable."""


class Executor(Protocol):
    """Runs step plans on one model, whatever the number of ranks or processes.

    `info` is known once the constructor returns (the runners are loaded and their KV caches
    sized). `execute` returns the sampling rank's result. `collective_rpc` calls a method of the
    `ModelRunner` on every rank and returns their answers in rank order: the hook for weight
    updates and anything else that must reach every shard. After an `ExecutorError` the engine
    reports itself unhealthy; `check_health` raises from then on.
    """

    info: RunnerInfo

    def execute(self, plan: StepPlan) -> StepResult: ...

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...

    def load_weight_bucket(self, bucket: bytes | dict[str, Any]) -> None:
        """One bucket of a weight update (safetensors bytes or named tensors) into every
        rank's slices (`ModelRunner.load_weight_bucket`)."""

    def check_health(self, ping: bool = True) -> None:
        """Raise ExecutorError when the runners cannot serve; `ping=False` skips asking each
        rank (no remote call), reporting only failures already seen."""

    def shutdown(self) -> None: ...
