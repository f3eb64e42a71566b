"""The in-process executor: one ModelRunner in the engine's own process (TP=1, the default)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from actors.executor.base import ExecutorError
from actors.runner.config import RunnerConfig
from actors.runner.model_runner import ModelRunner
from actors.runner.plan import StepPlan, StepResult


class UniExecutor:
    def __init__(self, config: RunnerConfig):
        if config.tensor_parallel_size != 1:
            raise ValueError("distributed_executor_backend='uni' runs one rank; "
                             f"tensor_parallel_size={config.tensor_parallel_size} needs 'ray'")
        self.runner = ModelRunner(config)
        self.info = self.runner.info()
        self._closed = False

    def execute(self, plan: StepPlan) -> StepResult:
        self.check_health()
        sent = time.perf_counter()
        result = self.runner.execute(plan)
        result.timings.update(sent_at=sent, received_at=time.perf_counter())
        return result

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self.check_health()
        return [getattr(self.runner, method)(*args, **kwargs)]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.collective_rpc("load_weights", weights)

    def load_weight_bucket(self, bucket: bytes | dict[str, Any]) -> None:
        self.collective_rpc("load_weight_bucket", bucket)

    def check_health(self, ping: bool = True) -> None:
        if self._closed:
            raise ExecutorError("the executor was shut down")

    def shutdown(self) -> None:
        self._closed = True
