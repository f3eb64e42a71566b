"""Routed experts (`enable_return_routed_experts`): each step's MoE routing recorded per KV
slot on the device (kv_cache.py), and reported for the positions each asking sequence newly
holds, so a prefix-cache hit returns the routing of the computation that filled its blocks."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.base import RunnerFeature
from raylane.actors.runner.features.replay_records import report_new_positions
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest


class RoutedExperts(RunnerFeature):
    name = "routed_experts"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return config.enable_return_routed_experts

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        if routed is not None:  # [T, num_moe_layers, top_k]
            self.runner.kv.store_routing(step.attn.slot_mapping, routed)

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        kv = self.runner.kv
        if result is not None and kv.routing is not None:
            report_new_positions(scheduled, result.routed_experts, "routed", kv.read_routing)
