"""Linear-attention state (a hybrid model's recurrent layers): per-sequence state slots and
their prefix-cache snapshots (state_cache.py). Before the forward, the plan's snapshot copies
and restores and the step's state metadata; after it, the snapshot saves; after sampling, a
verify row's slot takes its accepted tokens only. The slots come out of the KV cache's memory
budget."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.base import Runner, RunnerFeature
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import ScheduledRequest
from raylane.actors.runner.state_cache import StateCache


class LinearState(RunnerFeature):
    name = "linear_state"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return bool(getattr(model, "linear_layers", list)())

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner)
        config = runner.config
        self.cache = StateCache(
            runner.model.linear_layers(),
            config.num_state_slots,
            runner.dtype,
            runner.device,
            config.num_state_snapshots,
        )

    def before_forward(
        self, plan: StepPlan, scheduled: list[ScheduledRequest], step: StepInputs
    ) -> None:
        slot_of = dict(zip((seq_id for seq_id, _ in plan.scheduled), plan.state_slots))
        slots = [slot_of[item.state.seq_id] for item in scheduled]
        self.cache.copy(plan.snapshot_copies)  # before the restores that may read them
        self.cache.restore(plan.snapshot_restores)
        step.attn.linear = self.cache.metadata(scheduled, step.attn.num_prefills, slots)

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        assert step.attn.linear is not None
        self.cache.save_after(step.attn.linear, plan.snapshot_saves)

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        assert step.attn.linear is not None  # verify rows: the accepted tokens' states only
        self.cache.accept(step.attn.linear, scheduled, plan.snapshot_saves)

    def draws_on_every_rank(self, step: StepInputs) -> bool:
        # a verify row: every rank feeds the same accepted drafts into its slice of the state
        linear = step.attn.linear
        return linear is not None and linear.verify is not None

    def allows_verify_graphs(self) -> bool:
        return False  # a verify row's state records are host-side work

    def kv_reserved_bytes(self) -> int:
        return self.cache.num_bytes

    def info(self) -> dict[str, Any]:
        return {
            "num_state_slots": self.cache.num_slots,
            "num_state_snapshots": self.cache.num_snapshots,
            "state_bytes_per_seq": self.cache.bytes_per_seq,
        }
