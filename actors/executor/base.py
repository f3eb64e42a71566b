"""The executor protocol: the engine's only view of where and how the model runs."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from raylane.actors.models.weights import Payload
from raylane.actors.runner.config import RunnerInfo
from raylane.actors.runner.plan import StepError, StepPlan, StepResult


class ExecutorError(RuntimeError):
    """The runners can no longer serve (a shard died, or a rank raised while its peers waited
    in a collective); every later call raises too."""


class StepFailed(RuntimeError):
    """One step raised on the runners, which dropped its requests and serve on."""


class Executor(Protocol):
    """Runs step plans on one model, whatever the number of ranks or processes.

    `info` is known once the constructor returns (the runners are loaded and their KV caches
    sized). `submit` starts a step and returns a future of the sampling rank's result; steps
    run in the order they were submitted, so a plan may be submitted while the one before it
    runs (async scheduling). The future raises StepFailed when only that step failed, and
    ExecutorError when the runners are gone. `execute` is `submit(plan).result()`.
    `collective_rpc` calls a method of the `ModelRunner` on every rank and returns their
    answers in rank order: the hook for weight updates and anything else that must reach every
    shard. An executor may also offer `post_masks(step_id, masks)`: the grammar masks of a
    submitted plan's `late_masks` rows, as futures (the in-process one does; see
    actors/runner/mask_board.py). After an `ExecutorError` the engine
    reports itself unhealthy; `check_health` raises from then on.
    """

    info: RunnerInfo

    def submit(self, plan: StepPlan) -> Future[StepResult]: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...

    def load_weight_bucket(self, bucket: Payload | dict[str, Any]) -> None:
        """One bucket of a weight update (safetensors bytes, or a uint8 array of them, or
        named tensors) into every rank's slices (`RunnerWeights.load_bucket`)."""

    def check_health(self, ping: bool = True) -> None:
        """Raise ExecutorError when the runners cannot serve; `ping=False` skips asking each
        rank (no remote call), reporting only failures already seen."""

    def shutdown(self) -> None: ...


def result_or_step_failed(result: object, what: str) -> StepResult:
    """The reply of a step that may have raised on its own (a StepError): StepFailed then."""
    if isinstance(result, StepError):
        raise StepFailed(f"{what}: {result.message}")
    if not isinstance(result, StepResult):
        raise StepFailed(f"{what}: an unexpected reply {type(result).__name__}")
    return result
