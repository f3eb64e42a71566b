"""Tensor-parallel-ready layers. Each parameter carries `weight_loader(param, loaded, shard_id)`
that copies its rank's slice of a full checkpoint tensor, so model files stay plain composition.
`loaded` is a tensor or a `LazyTensor` (checkpoint.py): loaders only `narrow` / slice it, and
`copy_checked` reads just that slice.

At world size 1 every collective is a no-op; the hooks are where multi-process TP plugs in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from raylane.actors.models.checkpoint import LazyTensor, materialize
from raylane.actors.models.tp_group import TPGroup
from raylane.actors.models.tp_shape import split_evenly, split_kv_heads
from raylane.kernels.batch_invariant import padded_linear
from torch import nn

Loaded = torch.Tensor | LazyTensor  # what a weight_loader receives


def divide(total: int, parts: int, field: str) -> int:
    """`total // parts` for a `field` split over `parts` TP ranks; ValueError (see tp_shape)."""
    return split_evenly(total, parts, field)


def copy_checked(dst: torch.Tensor, src: Loaded, what: str) -> None:
    """Copy `src` (cast to dst's dtype) into `dst`, reading a lazy `src` only after the shape
    check; ValueError naming both shapes when they differ."""
    if dst.shape != src.shape:
        raise ValueError(
            f"weight {what}: checkpoint slice has shape {tuple(src.shape)}, "
            f"the model expects {tuple(dst.shape)}"
        )
    dst.copy_(materialize(src))


def split_rows(loaded: Loaded, dim: int, full: int, index: int, size: int, what: str) -> Loaded:
    """Rank slice `[index * size, (index + 1) * size)` of `loaded` along `dim`, after checking
    the checkpoint tensor is `full` long there: every rank then rejects a wrong tensor the same
    way, before any of them copies a slice (no half-loaded group, no silent truncation)."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(
            f"weight {what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"expected {full} along dim {dim}"
        )
    return loaded.narrow(dim, index * size, size)


def new_param(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    # torch gives Parameter no slot for it; the loader finds it by name, as vLLM's does
    setattr(param, "weight_loader", loader)
    return param


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    invariant: bool = False,
) -> torch.Tensor:
    """x [T, in] -> [T, out]; through the oneDNN-packed copy of `weight` when there is one;
    `invariant`: one reduction order per row whatever T (the batch-invariant mode)."""
    if invariant:
        return padded_linear(x, weight, bias, packed)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearBase(nn.Module):
    """weight [out_local, in_local] (+ bias [out_local]); subclasses decide the slicing."""

    packed: torch.Tensor | None = None  # a oneDNN-blocked copy of weight, see packing.py
    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)
    lora: Any = None  # the layer's adapter slots (actors/lora/layer_lora.py), when LoRA is on

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPGroup | None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        self.weight = new_param((out_local, in_local), self.weight_loader)
        self.bias = new_param((out_local,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.packed, self.invariant)
        return out if self.lora is None else self.lora.add(x, out)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. the MoE router)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None
    ) -> None:
        super().__init__(input_size, output_size, bias, tp)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None
    ) -> None:
        tp = tp or TPGroup()
        super().__init__(input_size, divide(output_size, tp.world_size, "output_size"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        size = param.shape[0]
        src = split_rows(loaded, 0, size * self.tp.world_size, self.tp.rank, size, "column")
        copy_checked(param.data, src, "column")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul, e.g. [gate | up]; shard_id = index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, tp)
        world = self.tp.world_size
        self.local_sizes = [divide(s, world, "output_sizes") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id for each part")
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        what = f"merged part {shard_id}"
        src = split_rows(loaded, 0, size * self.tp.world_size, self.tp.rank, size, what)
        copy_checked(param.data.narrow(0, offset, size), src, what)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection: rows [q heads | k heads | v heads] of this rank; shard_id q/k/v.

    KV heads are split across ranks, or replicated when there are fewer KV heads than ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        tp = tp or TPGroup()
        self.num_heads = divide(num_heads, tp.world_size, "num_attention_heads")
        # per rank: its own KV heads, or one KV head shared by `kv_replicas` ranks
        self.num_kv_heads, self.kv_replicas = split_kv_heads(num_kv_heads, tp.world_size)
        self.head_dim = head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.world_size
        super().__init__(hidden_size, total, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        world = self.tp.world_size
        if shard_id == "q":
            offset, size, index, full = 0, q_size, self.tp.rank, q_size * world
        elif shard_id in ("k", "v"):
            offset = q_size + (kv_size if shard_id == "v" else 0)
            size, index = kv_size, self.tp.rank // self.kv_replicas
            full = kv_size * world // self.kv_replicas  # every KV head once
        else:
            raise ValueError(f"QKVParallelLinear: shard_id must be q, k or v, got {shard_id!r}")
        what = f"qkv part {shard_id}"
        src = split_rows(loaded, 0, full, index, size, what)
        copy_checked(param.data.narrow(0, offset, size), src, what)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None
    ) -> None:
        tp = tp or TPGroup()
        super().__init__(divide(input_size, tp.world_size, "input_size"), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        if param.dim() == 1:  # bias: whole, added once after the reduce
            copy_checked(param.data, loaded, "row bias")
            return
        size = param.shape[1]
        src = split_rows(loaded, 1, size * self.tp.world_size, self.tp.rank, size, "row")
        copy_checked(param.data, src, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # an adapter's delta is a partial sum too (A split like the weight): added before
        # the reduce, so LoRA costs no collective of its own
        if self.bias is None or self.tp.world_size == 1:  # bias fused, like HF's nn.Linear
            out = linear(x, self.weight, self.bias, self.packed, self.invariant)
            return self.tp.all_reduce(out if self.lora is None else self.lora.add(x, out))
        partial = linear(x, self.weight, None, self.packed, self.invariant)
        if self.lora is not None:
            partial = self.lora.add(x, partial)
        return self.tp.all_reduce(partial) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks in contiguous ranges (the last range padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.world_size)
        self.start = self.tp.rank * self.per_rank
        self.weight = new_param((self.per_rank, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"weight vocab rows: checkpoint has {loaded.shape[0]}, "
                f"the model expects vocab_size {self.num_embeddings}"
            )
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        param.data[rows:].zero_()
        start = min(self.start, loaded.shape[0])  # a rank past a tiny vocab gets only padding
        copy_checked(param.data[:rows], loaded.narrow(0, start, rows), "vocab rows")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, D]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split by vocab rows like the embedding."""

    packed: torch.Tensor | None = None  # a oneDNN-blocked copy of weight, see packing.py
    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, D] -> [N, vocab] float32, padding rows of the last rank dropped
        logits = self.tp.all_gather_last(
            linear(hidden, self.weight, None, self.packed, self.invariant)
        )
        return logits[:, : self.num_embeddings].float()


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every layer that has a batch-invariant path (linears, the LM head, fused MoE
    experts: those whose class declares `invariant`) onto it; returns how many."""
    layers = [m for m in model.modules() if hasattr(type(m), "invariant")]
    for m in layers:
        setattr(m, "invariant", True)  # noqa: B010 - a class attribute mypy reads as a Module's
    return len(layers)
