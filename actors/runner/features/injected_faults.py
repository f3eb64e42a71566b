"""Injected failures (a test hook, runner/faults.py): the next armed steps raise before their
inputs are built ("prepare") or before the forward ("forward")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.faults import Faults
from raylane.actors.runner.features.base import RunnerFeature
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.plan import StepPlan
from raylane.actors.runner.requests import ScheduledRequest

if TYPE_CHECKING:
    from raylane.actors.runner.model_runner import ModelRunner


class InjectedFaults(RunnerFeature):
    name = "injected_faults"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return True

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.faults = Faults()

    def arm(self, stage: str, times: int = 1) -> None:
        self.faults.arm(stage, times)

    def before_prepare(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        self.faults.check("prepare")

    def before_forward(
        self, plan: StepPlan, scheduled: list[ScheduledRequest], step: StepInputs
    ) -> None:
        self.faults.check("forward")
