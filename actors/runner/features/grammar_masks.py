"""Grammar masks (structured outputs): the step's token masks, those in its plan and the late
ones the engine posts on the runner's `MaskBoard` while the forward runs (mask_board.py), in
`step.masks` before sampling; after the step's bookkeeping, a row whose late mask it skipped
computes its last position again."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.base import Runner, RunnerFeature
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.mask_board import roll_back_skipped, step_masks
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest


class GrammarMasks(RunnerFeature):
    name = "grammar_masks"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return True  # any request may carry a grammar

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner)
        # NOTE: a skipped row computes its last position again, which a recurrent state
        # (linear attention) would absorb twice: such models wait for late masks instead
        self.can_skip = not getattr(runner.model, "linear_layers", list)()

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        board = self.runner.mask_board
        step.masks = step_masks(board, plan, scheduled, can_skip=self.can_skip)

    def after_step(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        skipped = roll_back_skipped(scheduled, step.masks)
        if result is not None:
            result.skipped_seq_ids = tuple(skipped)
