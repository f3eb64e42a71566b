"""`LayerLoRA`: one linear layer's adapter slots, added to its output in the same forward.

Every slot's A and B sit in static buffers (rank padded to `max_rank` with zeros, PEFT's
scaling folded into B), so a step runs rows of any adapters, and base rows, in two matmuls:

    shrink = x @ A_all^T                    # [T, S * P * R], every slot's low-rank inputs
    shrink *= onehot(row's slot)            # zero outside the row's own slot (base: all zero)
    y += shrink @ B_all^T                   # [T, out]

S slots, P the parts of a fused layer (q/k/v, gate/up: each part's B fills only its rows of
the output), R the max rank. Base rows add exact zeros. Graphs replay it unchanged: only the
one-hot changes from step to step (ModelLoRA fills it from the plan).

Tensor parallel: a column-parallel layer keeps A whole and B's rows of this rank (through the
layer's own weight_loader, so B splits exactly as the base weight does); a row-parallel layer
keeps A's input columns of this rank and B whole, and its delta is a partial sum added before
the layer's all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.layers import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    linear,
)
from torch import nn

QKV_PARTS = ("q", "k", "v")


class LoRAStep:
    """The step's per-token slot one-hot [T, S], shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.onehot: torch.Tensor | None = None
        self.active = True  # False: no row of this step runs an adapter (eager: skip the math)


class LayerLoRA:
    def __init__(self, layer: LinearBase, num_slots: int, max_rank: int, step: LoRAStep) -> None:
        self.layer, self.step, self.rank = layer, step, max_rank
        self.row = isinstance(layer, RowParallelLinear)
        if not self.row and not isinstance(layer, ColumnParallelLinear):
            raise ValueError(f"LoRA on {type(layer).__name__} is not supported")
        self.parts = parts_of(layer)
        out_local, in_local = layer.weight.shape
        dtype, device = layer.weight.dtype, layer.weight.device
        width = len(self.parts) * max_rank  # one slot's columns
        self.a = torch.zeros(num_slots, width, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(out_local, num_slots, width, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] + each row's adapter delta of x [T, in]."""
        onehot = self.step.onehot
        # a CUDA graph keeps the math whatever the step it is captured at: replays of it
        # serve adapter rows too
        if onehot is None or not (self.step.active or _capturing(x)):
            return y
        slots, width = self.a.shape[0], self.a.shape[1]
        invariant = self.layer.invariant
        shrink = linear(x, self.a.view(slots * width, -1), None, None, invariant)
        shrink = (shrink.view(-1, slots, width) * onehot[:, :, None]).view(-1, slots * width)
        return y + linear(shrink, self.b.view(self.b.shape[0], -1), None, None, invariant)

    def prepare(
        self, parts: dict[Any, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's (A [P * R, in], B [out, P * R]) from full PEFT tensors per part, this
        rank's slices taken; ValueError on a wrong shape. Nothing is written yet."""
        a_slot = torch.zeros_like(self.a[0])
        b_slot = torch.zeros_like(self.b[:, 0])
        for shard_id, (a, b) in parts.items():
            r = a.shape[0]
            start = self.parts.index(shard_id) * self.rank
            what = f"LoRA {part_name(self.layer, shard_id)}"
            a_cols = a.to(torch.float32)
            b_rows = b.to(torch.float32) * scaling
            if self.row:  # A split along its input like the weight; B whole
                self.layer.weight_loader(_slice(a_slot[start : start + r]), a_cols, None)
                copy_checked(b_slot[:, start : start + r], b_rows, what + " B")
            else:  # A whole; B's rows of this rank, through the layer's own loader
                copy_checked(a_slot[start : start + r], a_cols, what + " A")
                rows = torch.zeros(b_slot.shape[0], r, dtype=b_slot.dtype, device=b_slot.device)
                self.layer.weight_loader(_slice(rows), b_rows, shard_id)  # its part's rows
                b_slot[:, start : start + r].copy_(rows)
        return a_slot, b_slot

    def write(self, slot: int, prepared: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.a[slot].copy_(prepared[0])
        self.b[:, slot].copy_(prepared[1])

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[:, slot].zero_()


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _slice(data: torch.Tensor) -> nn.Parameter:
    """What a layer's weight_loader writes into: a parameter over `data`'s storage (a view of
    the slot's buffer), so the loader's copies land there."""
    return nn.Parameter(data, requires_grad=False)


def parts_of(layer: LinearBase) -> tuple[Any, ...]:
    """The shard ids of a fused layer's parts, in output order; (None,) for a plain one."""
    if isinstance(layer, QKVParallelLinear):
        return QKV_PARTS
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.local_sizes)))
    return (None,)


def part_name(layer: LinearBase, shard_id: Any) -> str:
    return type(layer).__name__ + ("" if shard_id is None else f" part {shard_id}")
