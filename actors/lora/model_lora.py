"""`ModelLoRA`: a model's LoRA slots on one rank. It attaches a `LayerLoRA` to every linear
layer an adapter may target (q/k/v/o, gate/up/down), loads an adapter version into a slot,
and before each forward turns the rows' slots into the one-hot the layers read.

Slots are numbered 1..max_loras (0 = the base model). An adapter's HF module paths map onto
the model's fused layers through its `packed_modules_mapping` / `stacked_params_mapping`
(q_proj -> qkv_proj part "q", gate_proj -> gate_up_proj part 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from raylane.actors.lora.adapter import LoRAWeights
from raylane.actors.lora.layer_lora import LayerLoRA, LoRAStep
from raylane.actors.lora.peft_config import TARGETS
from raylane.actors.models.layers import LinearBase
from torch import nn


class ModelLoRA:
    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, max_rows: int, device: Any
    ) -> None:
        self.model, self.max_loras = model, max_loras
        self.step = LoRAStep()
        self.fused = _fused_names(model)
        self.layers: dict[str, LayerLoRA] = {}
        for path, module in model.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if isinstance(module, LinearBase) and (leaf in TARGETS or leaf in self._fused_leaves):
                lora = LayerLoRA(module, max_loras, max_rank, self.step)
                module.lora = lora
                self.layers[path] = lora
        # each row's slot (0: base); graph replay reads the same buffer
        self.row_slots = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._columns = torch.arange(1, max_loras + 1, device=device)
        self._hook = model.register_forward_pre_hook(self._before_model)

    @property
    def _fused_leaves(self) -> set[str]:
        return {fused for fused, _ in self.fused.values()}

    def set_rows(self, slots: Sequence[int]) -> None:
        """The step's rows' slots, in `scheduled` order (padding rows get 0)."""
        self.row_slots.zero_()
        if slots:
            self.row_slots[: len(slots)].copy_(torch.tensor(slots, dtype=torch.long))
        self.step.active = any(slot > 0 for slot in slots)

    def _before_model(self, module: nn.Module, args: tuple) -> None:
        input_ids, attn = args[0], args[2]
        starts = attn.query_start_loc  # [B + 1]: row i's tokens are [starts[i], starts[i + 1])
        tokens = torch.arange(input_ids.shape[0], device=starts.device, dtype=starts.dtype)
        rows = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)
        rows = rows.clamp_(max=max(starts.shape[0] - 2, 0))
        slots = self.row_slots[rows]  # [T]
        dtype = next(iter(self.layers.values())).a.dtype if self.layers else torch.float32
        self.step.onehot = (slots[:, None] == self._columns[None, :]).to(dtype)  # [T, S]

    # --- loading ------------------------------------------------------------------------------

    def check(self, weights: LoRAWeights) -> None:
        """Raise ValueError if `weights` would not load (a module the model lacks, a shape
        from another base model); changes nothing."""
        self._prepare(weights)

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Put an adapter version into `slot` (1..max_loras): every layer checked first, then
        written; the layers it does not target are cleared in that slot."""
        self._check_slot(slot)
        prepared = self._prepare(weights)
        for path, lora in self.layers.items():
            if path in prepared:
                lora.write(slot - 1, prepared[path])
            else:
                lora.clear(slot - 1)

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        for lora in self.layers.values():
            lora.clear(slot - 1)

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"lora slot must be in 1..{self.max_loras}, got {slot}")

    def _prepare(self, weights: LoRAWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        grouped: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in weights.modules.items():
            path, shard_id = self._locate(module)
            grouped.setdefault(path, {})[shard_id] = pair
        return {
            path: self.layers[path].prepare(parts, weights.scaling)
            for path, parts in grouped.items()
        }

    def _locate(self, module: str) -> tuple[str, Any]:
        """HF module path -> (our layer's path, part shard id)."""
        parent, _, leaf = module.rpartition(".")
        fused, shard_id = self.fused.get(leaf, (leaf, None))
        path = f"{parent}.{fused}" if parent else fused
        if path not in self.layers:
            raise ValueError(
                f"target_modules: the model has no LoRA-capable module {module!r} "
                "(another architecture, more layers, or an MoE expert)"
            )
        return path, shard_id


def _fused_names(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """HF projection name -> (our fused layer name, its shard id)."""
    mapping = getattr(model, "stacked_params_mapping", None) or []
    return {hf: (ours, shard_id) for ours, hf, shard_id in mapping if hf in TARGETS}
