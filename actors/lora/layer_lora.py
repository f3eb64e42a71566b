"""`LayerLoRA`: one linear layer's adapter slots, added to its output in the same forward.

Every slot's A and B sit in static buffers (rank padded to `max_rank` with zeros, PEFT's
scaling folded into B; P the parts of a fused layer (q/k/v, gate/up: each part's B fills only
its rows of the output), R the max rank). Two ways to add the deltas:

- eager (SGMV-style): the step's tokens grouped by slot once per step (ModelLoRA, `LoRAGroups`),
  each token then runs its own slot only: y[rows] += x[rows] @ A_s^T @ B_s^T. When the active
  slots hold about as many tokens each (decode batches), one gather of x into [S', M, in]
  (sorted by slot, short groups padded with zero rows), two bmm over the slots and one
  index_add_ back; otherwise (and in the batch-invariant mode, through its padded `linear`) a
  loop over the active slots, slicing x where a slot's tokens sit side by side. Base tokens
  add nothing.
- eager on the CPU (float32, bfloat16; not in the batch-invariant mode): kernels/lora.py's C
  kernel, one call per layer reading the step's token -> slot list (`LoRAStep.tokens`), the
  low-rank math in float32 on copies of the weights in its own layout.
- CUDA graph capture (static shapes; the replays serve any mix of slots): every slot at once,
      shrink = x @ A_all^T                # [T, S * P * R], every slot's low-rank inputs
      shrink *= onehot(row's slot)        # zero outside the row's own slot (base: all zero)
      y += shrink @ B_all^T               # [T, out]
  where only the one-hot changes from replay to replay (ModelLoRA fills it from the plan).

Tensor parallel: a column-parallel layer keeps A whole and B's rows of this rank (through the
layer's own weight_loader, so B splits exactly as the base weight does); a row-parallel layer
keeps A's input columns of this rank and B whole, and its delta is a partial sum added before
the layer's all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
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
from raylane.kernels.lora import KERNEL_DTYPES, LoRAKernelWeights, LoRATokens, lora_kernel
from torch import nn

QKV_PARTS = ("q", "k", "v")


class LoRAGroups:
    """The step's adapter tokens grouped by slot, for the eager path. `segments`: (slot index,
    start, end) per active slot, rows [start, end) of x itself when `order` is None (each
    slot's tokens side by side), else of x[order] (the adapter tokens sorted by slot), which
    `unsort` adds back to the tokens. `m`: every group padded to m rows (pads repeat a token,
    `keep` [rows, 1] zeroes them; None when none is short), so the groups run as one bmm over
    `slots` (their slot indices; None: all the slots, in order); None: a loop over the groups."""

    def __init__(
        self,
        segments: list[tuple[int, int, int]],
        order: torch.Tensor | None = None,
        unsort: Unsort | None = None,
    ) -> None:
        self.segments, self.order, self.unsort = segments, order, unsort
        self.m: int | None = None
        self.keep: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None


class Unsort:
    """Adds rows sorted by slot back onto x's tokens: token t gets row `inverse[t]`, times
    `mask[t]` (0: a token with no adapter; None: every token has one)."""

    def __init__(self, inverse: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.inverse, self.mask = inverse, mask

    def add_to(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        rows = delta.index_select(0, self.inverse)
        return y.add_(rows) if self.mask is None else y.addcmul_(rows, self.mask)


class LoRAStep:
    """What every LoRA layer of a model reads for the step: the per-token slot one-hot [T, S]
    while a CUDA graph is captured; otherwise the adapter tokens sorted by slot for the C
    kernel (`tokens`, when ModelLoRA has it) and the slot groups of the torch path, built on
    first use (a layer the kernel does not take)."""

    def __init__(self) -> None:
        self.onehot: torch.Tensor | None = None
        self.tokens: LoRATokens | None = None
        self._groups: LoRAGroups | None = None
        self._make_groups: Callable[[], LoRAGroups | None] | None = None

    def set_eager(
        self, tokens: LoRATokens | None, make_groups: Callable[[], LoRAGroups | None] | None
    ) -> None:
        """The step's tokens (None: no kernel) and what builds its groups (None: no token of
        this step runs an adapter)."""
        self.onehot, self.tokens = None, tokens
        self._groups, self._make_groups = None, make_groups

    @property
    def groups(self) -> LoRAGroups | None:
        if self._make_groups is not None:
            self._groups, self._make_groups = self._make_groups(), None
        return self._groups


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
        self.b = torch.zeros(num_slots, out_local, width, dtype=dtype, device=device)
        self.kernel = lora_kernel() if device.type == "cpu" and dtype in KERNEL_DTYPES else None
        self.kernel_weights = None  # the same slots in the C kernel's layout
        if self.kernel is not None:
            ends = torch.tensor(part_sizes(layer)).cumsum(0).tolist()
            self.kernel_weights = LoRAKernelWeights(num_slots, max_rank, in_local, ends, dtype)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] + each row's adapter delta of x [T, in]."""
        step = self.step
        if step.onehot is not None:  # set while a CUDA graph is captured: the graph
            return self._add_masked(x, y, step.onehot)  # keeps the math for its replays
        if step.tokens is not None and self.kernel is not None and self.kernel.takes(x, y):
            assert self.kernel_weights is not None
            self.kernel.add(x, y, step.tokens, self.kernel_weights)
            return y
        groups = step.groups
        if groups is None:
            return y
        if groups.order is None or groups.unsort is None:  # each slot's tokens side by side
            for slot, start, end in groups.segments:
                y[start:end] += self._delta(x[start:end], slot)
            return y
        rows = x.index_select(0, groups.order)
        if groups.keep is not None:
            rows.mul_(groups.keep)  # pad rows: zero, so their deltas are zero
        if groups.m is not None:  # never in the batch-invariant mode (ModelLoRA)
            delta = self._batched_delta(rows, groups.m, groups.slots)
        else:
            deltas = [self._delta(rows[start:end], slot) for slot, start, end in groups.segments]
            delta = torch.cat(deltas) if len(deltas) > 1 else deltas[0]
        return groups.unsort.add_to(y, delta)

    def _delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """x [n, in] @ A_slot^T @ B_slot^T: [n, out] (the batch-invariant mode's `linear`)."""
        invariant = self.layer.invariant
        shrink = linear(x, self.a[slot], None, None, invariant)
        return linear(shrink, self.b[slot], None, None, invariant)

    def _batched_delta(
        self, rows: torch.Tensor, m: int, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [S' * m, in], m per slot of `slots` -> their deltas [S' * m, out]."""
        a, b = self.a, self.b
        if slots is not None:
            a, b = a.index_select(0, slots), b.index_select(0, slots)
        shrink = torch.bmm(rows.view(a.shape[0], m, -1), a.transpose(1, 2))
        delta = torch.bmm(shrink, b.transpose(1, 2))  # [S', m, out]
        return delta.view(-1, delta.shape[-1])

    def _add_masked(self, x: torch.Tensor, y: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        slots, width = self.a.shape[0], self.a.shape[1]
        invariant = self.layer.invariant
        shrink = linear(x, self.a.view(slots * width, -1), None, None, invariant)
        shrink = (shrink.view(-1, slots, width) * onehot[:, :, None]).view(-1, slots * width)
        b_all = self.b.permute(1, 0, 2).reshape(self.b.shape[1], -1)  # [out, S * width]
        return y + linear(shrink, b_all, None, None, invariant)

    def prepare(
        self, parts: dict[Any, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's (A [P * R, in], B [out, P * R]) from full PEFT tensors per part, this
        rank's slices taken; ValueError on a wrong shape. Nothing is written yet."""
        a_slot = torch.zeros_like(self.a[0])
        b_slot = torch.zeros_like(self.b[0])
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
        self.b[slot].copy_(prepared[1])
        if self.kernel_weights is not None:  # from the stored (model dtype) values
            self.kernel_weights.write(slot, self.a[slot], self.b[slot])

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.kernel_weights is not None:
            self.kernel_weights.write(slot, self.a[slot], self.b[slot])


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


def part_sizes(layer: LinearBase) -> list[int]:
    """This rank's output columns of each part, in `parts_of` order."""
    if isinstance(layer, QKVParallelLinear):
        kv = layer.num_kv_heads * layer.head_dim
        return [layer.num_heads * layer.head_dim, kv, kv]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.local_sizes)
    return [layer.weight.shape[0]]


def part_name(layer: LinearBase, shard_id: Any) -> str:
    return type(layer).__name__ + ("" if shard_id is None else f" part {shard_id}")
