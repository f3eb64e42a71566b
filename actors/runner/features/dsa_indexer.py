"""A DSA model's indexer top-k (`enable_return_indexer_topk`): the positions each token's
sparse attention chose, recorded per KV slot on the device (kv_cache.py) and reported like
routed experts."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.base import RunnerFeature
from raylane.actors.runner.features.replay_records import report_new_positions
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest


class DsaIndexer(RunnerFeature):
    name = "dsa_indexer"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return config.enable_return_indexer_topk and bool(getattr(model, "num_dsa_layers", 0))

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        # [T, dsa_layers, index_topk]: the step's selections, per KV slot
        chosen = self.runner.model.indexer_topk()[: step.attn.num_tokens]
        self.runner.kv.store_indexer(step.attn.slot_mapping, chosen)

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        kv = self.runner.kv
        if result is not None and kv.indexer is not None:
            report_new_positions(scheduled, result.indexer_topk, "indexer", kv.read_indexer)

    def allows_verify_graphs(self) -> bool:
        return False  # a verify row's per-token selections are host-side work
