"""LoRA under tensor parallelism, in process (no process group: each rank's layer is built
with its TPGroup and run alone): a column-parallel layer's ranks hold A whole and B's rows
split as the base weight is (q/k/v by heads, KV heads replicated when fewer than ranks, gate/up
each by halves), a row-parallel layer's ranks hold A's input columns, and their deltas put
together (concatenated, or summed before the all-reduce) equal the whole adapter's
x @ A^T @ B^T * scaling computed with plain torch."""

from __future__ import annotations

import pytest
import torch
from raylane.actors.lora.layer_lora import LayerLoRA, LoRAStep
from raylane.actors.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)

HIDDEN, HEAD_DIM, RANK, MAX_RANK, SCALE = 32, 8, 3, 4, 0.5


def _delta(layer, parts: dict, x: torch.Tensor) -> torch.Tensor:
    step = LoRAStep()
    step.onehot = torch.ones(x.shape[0], 1)  # every row on slot 1
    lora = LayerLoRA(layer, 1, MAX_RANK, step)
    lora.write(0, lora.prepare(parts, SCALE))
    out = torch.zeros(x.shape[0], layer.weight.shape[0])
    return lora.add(x, out)


def _pair(out: int, inp: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(RANK, inp, generator=gen), torch.randn(out, RANK, generator=gen)


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(4, 2, 2), (4, 1, 2), (4, 2, 1)])
def test_qkv_column_split(heads: int, kv_heads: int, world: int) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = {"q": heads * HEAD_DIM, "k": kv_heads * HEAD_DIM, "v": kv_heads * HEAD_DIM}
    parts = {p: _pair(n, HIDDEN, gen) for p, n in sizes.items()}
    x = torch.randn(5, HIDDEN, generator=gen)
    whole = {p: x @ a.T @ b.T * SCALE for p, (a, b) in parts.items()}  # [T, out_p]
    for rank in range(world):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, tp=TPGroup(rank, world))
        got = _delta(layer, parts, x)
        q, kv = layer.num_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM
        kv_index = rank // layer.kv_replicas
        expect = torch.cat(
            [
                whole["q"][:, rank * q : (rank + 1) * q],
                whole["k"][:, kv_index * kv : (kv_index + 1) * kv],
                whole["v"][:, kv_index * kv : (kv_index + 1) * kv],
            ],
            dim=1,
        )
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_gate_up_split_and_row_partial_sums() -> None:
    gen = torch.Generator().manual_seed(1)
    inter, world = 16, 2
    parts = {0: _pair(inter, HIDDEN, gen), 1: _pair(inter, HIDDEN, gen)}
    x = torch.randn(4, HIDDEN, generator=gen)
    for rank in range(world):
        layer = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp=TPGroup(rank, world))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        expect = torch.cat([(x @ a.T @ b.T * SCALE)[:, half] for a, b in parts.values()], 1)
        torch.testing.assert_close(_delta(layer, parts, x), expect, rtol=1e-5, atol=1e-5)
    a, b = _pair(HIDDEN, inter, gen)
    h = torch.randn(4, inter, generator=gen)
    total = torch.zeros(4, HIDDEN)
    for rank in range(world):
        layer = RowParallelLinear(inter, HIDDEN, tp=TPGroup(rank, world))
        local = h[:, rank * inter // 2 : (rank + 1) * inter // 2]
        total += _delta(layer, {None: (a, b)}, local)  # what the all-reduce sums
    torch.testing.assert_close(total, h @ a.T @ b.T * SCALE, rtol=1e-5, atol=1e-5)


def test_rows_of_other_slots_and_base_rows_add_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = RowParallelLinear(HIDDEN, HIDDEN)
    step = LoRAStep()
    lora = LayerLoRA(layer, 2, MAX_RANK, step)
    a, b = _pair(HIDDEN, HIDDEN, gen)
    lora.write(1, lora.prepare({None: (a, b)}, SCALE))  # slot 2 only
    x = torch.randn(3, HIDDEN, generator=gen)
    step.onehot = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # base, slot 1, slot 2
    y = torch.randn(3, HIDDEN, generator=gen)
    got = lora.add(x, y.clone())
    assert torch.equal(got[:2], y[:2])  # exact: zeros added
    torch.testing.assert_close(got[2], y[2] + x[2] @ a.T @ b.T * SCALE, rtol=1e-5, atol=1e-5)
