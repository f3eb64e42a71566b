"""The in-process executor: one ModelRunner in the engine's own process (TP=1, the default).

Every call that touches the runner (steps, weight loads, test hooks) runs on one worker
thread, in the order it was made, so the engine's thread is free while a step runs: with async
scheduling it plans the next step meanwhile. Measured on the 2-core dev machine, a SmolLM2
step on the worker costs the same as on the calling thread (the engine's thread runs no torch
work of its own during a step, so the two threads' OpenMP teams do not compete).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raylane.actors.executor.base import ExecutorError, StepFailed, result_or_step_failed
from raylane.actors.models.weights import Payload
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.mask_board import MaskBoard
from raylane.actors.runner.model_runner import ModelRunner
from raylane.actors.runner.plan import StepPlan, StepResult


class UniExecutor:
    def __init__(self, config: RunnerConfig):
        if config.tensor_parallel_size != 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one rank; "
                f"tensor_parallel_size={config.tensor_parallel_size} needs 'ray'"
            )
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="raylane-runner")
        self.runner = self._worker.submit(ModelRunner, config).result()
        self.info = self.runner.info()
        # grammar masks reach the runner after its plan (async scheduling of constrained steps)
        self.mask_board = self.runner.mask_board = MaskBoard()
        self._closed = False

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        self.check_health()
        return self._worker.submit(self._step, plan, time.perf_counter())

    def execute(self, plan: StepPlan) -> StepResult:
        return self.submit(plan).result()

    def post_masks(self, step_id: int, masks: dict[int, Future]) -> None:
        """The grammar masks of a submitted plan's `late_masks` rows (see MaskBoard)."""
        self.mask_board.post(step_id, masks)

    def _step(self, plan: StepPlan, sent: float) -> StepResult:
        try:
            result = result_or_step_failed(self.runner.execute(plan), f"step {plan.step_id}")
        except StepFailed:
            raise
        except Exception as e:  # the runner dropped the step's requests and serves on
            raise StepFailed(f"step {plan.step_id} failed: {e!r}") from e
        result.timings.update(sent_at=sent, received_at=time.perf_counter())
        return result

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self.check_health()
        call: Any = functools.reduce(getattr, method.split("."), self.runner)  # "weights.x"
        return [self._worker.submit(call, *args, **kwargs).result()]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.collective_rpc("load_weights", weights)

    def load_weight_bucket(self, bucket: Payload | dict[str, Any]) -> None:
        self.collective_rpc("weights.load_bucket", bucket)

    def check_health(self, ping: bool = True) -> None:
        if self._closed:
            raise ExecutorError("the executor was shut down")

    def shutdown(self) -> None:
        self._closed = True
        self.mask_board.close()
        self._worker.shutdown(wait=False, cancel_futures=True)
