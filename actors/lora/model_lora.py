"""`ModelLoRA`: a model's LoRA slots on one rank. It attaches a `LayerLoRA` to every linear
layer an adapter may target (q/k/v/o, gate/up/down), loads an adapter version into a slot,
and before each forward turns the rows' slots into what the layers read: the tokens grouped by
slot (eager), or the per-token slot one-hot (while a CUDA graph is captured).

Slots are numbered 1..max_loras (0 = the base model). An adapter's HF module paths map onto
the model's fused layers through its `packed_modules_mapping` / `stacked_params_mapping`
(q_proj -> qkv_proj part "q", gate_proj -> gate_up_proj part 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from raylane.actors.lora.adapter import LoRAWeights
from raylane.actors.lora.layer_lora import LayerLoRA, LoRAGroups, LoRAStep, Unsort
from raylane.actors.lora.peft_config import TARGETS
from raylane.actors.models.layers import LinearBase
from raylane.kernels.lora import LoRATokens
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
        first = next(iter(self.layers.values()), None)
        self._dtype = first.a.dtype if first is not None else torch.float32
        self._slots: list[int] = []  # the same, on the host
        # every layer on the C kernel (CPU, float32 or bfloat16): the step's sorted tokens
        self._kernel = bool(self.layers) and all(
            lora.kernel_weights is not None for lora in self.layers.values()
        )
        self._hook = model.register_forward_pre_hook(self._before_model)

    @property
    def _fused_leaves(self) -> set[str]:
        return {fused for fused, _ in self.fused.values()}

    def set_rows(self, slots: Sequence[int]) -> None:
        """The step's rows' slots, in `scheduled` order (padding rows get 0)."""
        self._slots = list(slots)
        self.row_slots.zero_()
        if slots:
            self.row_slots[: len(slots)].copy_(torch.tensor(slots, dtype=torch.long))

    def _before_model(self, module: nn.Module, args: tuple) -> None:
        input_ids, attn = args[0], args[2]
        starts = attn.query_start_loc  # [B + 1]: row i's tokens are [starts[i], starts[i + 1])
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            self.step.set_eager(None, None)
            self.step.onehot = self._onehot(input_ids, starts)
            return
        spans = _spans(self._slots, starts.tolist()) if any(s > 0 for s in self._slots) else {}
        if not spans:
            self.step.set_eager(None, None)
            return
        invariant = next(iter(self.layers.values())).layer.invariant
        # the batch-invariant mode keeps the torch path (its padded `linear` per group)
        tokens = None if invariant or not self._kernel else _sorted_tokens(spans)
        self.step.set_eager(tokens, lambda: self._groups(input_ids, spans, invariant))

    def _groups(
        self, input_ids: torch.Tensor, spans: dict[int, list[tuple[int, int]]], invariant: bool
    ) -> LoRAGroups:
        segments = [(slot, *runs[0]) for slot, runs in spans.items()]
        if all(len(runs) == 1 for runs in spans.values()):
            return LoRAGroups(segments)  # each slot's tokens side by side: slices of x
        members = {slot: [t for a, b in runs for t in range(a, b)] for slot, runs in spans.items()}
        # the batch-invariant mode's padded `linear` per group, not a bmm whose reduction
        # order may change with the groups' sizes
        return _sorted_groups(
            members,
            input_ids.shape[0],
            self.max_loras,
            not invariant,
            self._dtype,
            input_ids.device,
        )

    def _onehot(self, input_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """[T, S]: 1 at each token's slot column, from the static row slots (graphs replay it)."""
        tokens = torch.arange(input_ids.shape[0], device=starts.device, dtype=starts.dtype)
        rows = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)
        rows = rows.clamp_(max=max(starts.shape[0] - 2, 0))
        slots = self.row_slots[rows]  # [T]
        return (slots[:, None] == self._columns[None, :]).to(self._dtype)

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


def _spans(row_slots: list[int], bounds: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Slot index (slot - 1) -> its token ranges, adjacent rows merged, slots in order."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, slot in enumerate(row_slots):
        start, end = bounds[row], bounds[row + 1]
        if slot <= 0 or end <= start:
            continue
        runs = spans.setdefault(slot - 1, [])
        if runs and runs[-1][1] == start:  # the previous row's tokens end where these begin
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return dict(sorted(spans.items()))


def _sorted_tokens(spans: dict[int, list[tuple[int, int]]]) -> LoRATokens:
    """The adapter tokens sorted by slot (in token order within one), for the C kernel."""
    tokens: list[int] = []
    slots: list[int] = []
    for slot, runs in spans.items():
        for start, end in runs:
            tokens.extend(range(start, end))
            slots.extend([slot] * (end - start))
    return LoRATokens(tokens, slots)


PAD_WASTE = 1.5  # one bmm over padded groups when they hold at most this many rows per token


def _sorted_groups(
    members: dict[int, list[int]],
    tokens: int,
    max_loras: int,
    may_pad: bool,
    dtype: torch.dtype,
    device: Any,
) -> LoRAGroups:
    """The adapter tokens sorted by slot (`members`: slot index -> its tokens), each group
    padded to the largest when that wastes little (then one bmm runs them all)."""
    sizes = [len(group) for group in members.values()]
    m = max(sizes)
    batched = may_pad and m * len(sizes) <= PAD_WASTE * sum(sizes)
    order: list[int] = []
    keep: list[float] = []
    segments = []
    for slot, group in members.items():
        pads = m - len(group) if batched else 0
        segments.append((slot, len(order), len(order) + len(group)))
        order.extend(group + group[:1] * pads)
        keep.extend([1.0] * len(group) + [0.0] * pads)
    inverse, mask = [0] * tokens, [0.0] * tokens
    for row, (token, kept) in enumerate(zip(order, keep)):
        if kept:
            inverse[token], mask[token] = row, 1.0
    base_rows = None if all(mask) else torch.tensor(mask, dtype=dtype, device=device)[:, None]
    unsort = Unsort(torch.tensor(inverse, dtype=torch.long, device=device), base_rows)
    groups = LoRAGroups(segments, torch.tensor(order, dtype=torch.long, device=device), unsort)
    if batched:
        groups.m = m
        if not all(keep):
            groups.keep = torch.tensor(keep, dtype=dtype, device=device)[:, None]
        if list(members) != list(range(max_loras)):
            groups.slots = torch.tensor(list(members), dtype=torch.long, device=device)
    return groups
