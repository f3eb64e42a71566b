"""Multi-LoRA on the runner (`EngineConfig.enable_lora`): the model's adapter slots
(actors/lora/model_lora.py), loaded between steps by the engine (`collective_rpc("features.call",
"lora", "load", slot, weights)`), and each step's rows' slots, from the plan, set before the
forward (into the static buffer a graph replay reads too)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from raylane.actors.lora.model_lora import ModelLoRA
from raylane.actors.runner.features.base import Runner, RunnerFeature

if TYPE_CHECKING:
    from raylane.actors.lora.adapter import LoRAWeights
    from raylane.actors.runner.config import RunnerConfig
    from raylane.actors.runner.inputs import StepInputs
    from raylane.actors.runner.plan import StepPlan
    from raylane.actors.runner.requests import ScheduledRequest


class LoRA(RunnerFeature):
    name = "lora"

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        return config.max_loras > 0

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner)
        config = runner.config
        rows = max(config.cudagraph_capture_sizes)  # max_num_seqs: every step's rows fit
        self.slots = ModelLoRA(
            runner.model, config.max_loras, config.max_lora_rank, rows, runner.device
        )
        self._slot_of: dict[int, int] = {}  # seq_id -> its adapter's slot (0: none)

    def before_forward(
        self, plan: StepPlan, scheduled: list[ScheduledRequest], step: StepInputs
    ) -> None:
        for new in plan.new_requests:
            if new.lora_slot:
                self._slot_of[new.seq_id] = new.lora_slot
        self.slots.set_rows([self._slot_of.get(item.state.seq_id, 0) for item in scheduled])

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._slot_of.pop(seq_id, None)

    # --- called by the engine, on every rank, between steps ----------------------------------

    def check(self, weights: LoRAWeights) -> None:
        """Raise ValueError when `weights` would not load here; changes nothing."""
        self.slots.check(weights)

    def load(self, slot: int, weights: LoRAWeights) -> None:
        self.slots.load(slot, weights)
