"""Speculative method "draft_model": a draft model beside the target (draft_runner.py) draws
the drafts of the rows the plan asks for, before the step's inputs are built. Its KV pool
spans the target's block ids (each block pays for its bytes too), its tensors ride in the
target's weight updates (`draft.<name>`), and it sleeps and wakes with the target."""

from __future__ import annotations

from typing import Any

from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.draft_runner import DraftRunner
from raylane.actors.runner.features.base import Runner, RunnerFeature
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest


class DraftModel(RunnerFeature):
    name = "draft_model"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return config.draft_model_dir is not None

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner)
        self.draft = DraftRunner(runner.config, runner.tp, runner.dtype, runner.device)
        runner.weights.draft = self.draft.weights  # checked, saved and rolled back together

    def before_prepare(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        self.draft.propose(scheduled, self.runner.inputs, self.runner.sampler)

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        if result is not None and any(item.num_to_draft for item in scheduled):
            # the drafts it drew, for the engine
            result.drafts = [item.drafts if item.num_to_draft else None for item in scheduled]

    def kv_bytes_per_token(self) -> int:
        return self.draft.bytes_per_token()

    def kv_allocated(self, num_blocks: int) -> None:
        self.draft.allocate(num_blocks)  # a parallel pool, indexed by group 0's block ids

    def extra_models(self) -> list[Any]:
        return [self.draft.model]

    def weight_checksums(self) -> dict[str, str]:
        return self.draft.checksums()
