"""Tensor parallelism for fused per-head tensors (linear-attention layers): a checkpoint tensor
made of parts laid end to end along dim 0 ([q heads | k heads | v heads] for Gated DeltaNet's
`in_proj_qkv` and its conv weight, or one part of value heads for `dt_bias` and `A_log`), of
which each rank keeps its slice of every part, in the same order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from raylane.actors.models.checkpoint import materialize
from raylane.actors.models.layers import ColumnParallelLinear, Loaded, copy_checked
from raylane.actors.models.tp_group import TPGroup
from raylane.actors.models.tp_shape import split_evenly
from torch import nn


def split_parts(loaded: Loaded, sizes: list[int], tp: TPGroup, what: str) -> torch.Tensor:
    """This rank's slice of each part (full sizes `sizes` along dim 0), concatenated."""
    t = materialize(loaded)
    if t.shape[0] != sum(sizes):
        raise ValueError(
            f"weight {what}: checkpoint tensor has shape {tuple(t.shape)}, "
            f"expected {sum(sizes)} along dim 0"
        )
    local = [split_evenly(s, tp.world_size, what) for s in sizes]
    parts = t.split(sizes)
    return torch.cat([p.narrow(0, tp.rank * n, n) for p, n in zip(parts, local)])


def parts_loader(sizes: list[int], tp: TPGroup, what: str) -> Callable[..., None]:
    """A weight_loader for a plain parameter holding this rank's slice of each part."""

    def load(param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        copy_checked(param.data, split_parts(loaded, sizes, tp, what), what)

    return load


class PartsColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose output is several parts (full sizes `sizes`), each split
    across ranks; the checkpoint holds the whole fused weight."""

    def __init__(self, input_size: int, sizes: list[int], tp: TPGroup) -> None:
        super().__init__(input_size, sum(sizes), False, tp)
        self.sizes = sizes

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        copy_checked(param.data, split_parts(loaded, self.sizes, self.tp, "parts"), "parts")
