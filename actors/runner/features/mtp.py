"""Speculative method "mtp": after each step's sampling the model's MTP layers run over the
step's rows and propose each sampling sequence's next drafts (mtp_drafts.py). They read the
main forward's hidden states, so every forward runs eagerly, and every rank draws the step's
tokens (each feeds them to the MTP layers, whose collectives need the same rows)."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.base import Runner, RunnerFeature
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.mtp_drafts import attach_draft_probs, mtp_drafts
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest


class MtpDrafts(RunnerFeature):
    name = "mtp"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return config.mtp

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner)
        if not len(getattr(runner.model, "mtp_layers", ())):
            raise ValueError(
                "EngineConfig.speculative_config.method='mtp': the model has no MTP layers "
                "(num_nextn_predict_layers or mtp_num_hidden_layers in its config, with their "
                "weights in the checkpoint; a checkpoint transformers saved has none)"
            )
        self._hidden: torch.Tensor | None = None  # [T, H]: this step's main forward's

    def before_prepare(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        attach_draft_probs(scheduled)  # q of last step's drafts, for the rows verifying them

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        assert hidden is not None  # an eager forward ran (`allows_graph_replay`)
        self._hidden = hidden

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        hidden, self._hidden = self._hidden, None
        assert hidden is not None
        # (chained steps run only the MTP block's full attention: no linear state)
        runner = self.runner
        num_drafts = runner.config.num_mtp_drafts
        drafts = mtp_drafts(runner.model, scheduled, step, hidden, runner.sampler, num_drafts)
        if result is not None:
            result.mtp_drafts = drafts

    def draws_on_every_rank(self, step: StepInputs) -> bool:
        return True  # every rank feeds the sampled tokens to the MTP layers

    def allows_graph_replay(self) -> bool:
        return False  # the MTP layers read the hidden states

    def allows_verify_graphs(self) -> bool:
        return False
