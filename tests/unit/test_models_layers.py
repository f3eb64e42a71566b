"""Tensor-parallel layers: each rank's weight_loader takes its slice; ranks reassemble the whole."""

from __future__ import annotations

import pytest
import torch
from raylane.actors.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from raylane.actors.models.qwen3_moe import FusedMoE

WORLD = 2


def _load(layer, name: str, full: torch.Tensor, shard=None) -> torch.Tensor:
    param = getattr(layer, name)
    param.weight_loader(param, full, shard)
    return param.data


def test_column_and_row_slices_reassemble():
    w = torch.randn(8, 6)
    cols = [
        _load(ColumnParallelLinear(6, 8, tp=TPGroup(r, WORLD)), "weight", w) for r in range(WORLD)
    ]
    assert torch.equal(torch.cat(cols, 0), w)
    rows = [
        _load(RowParallelLinear(8, 6, tp=TPGroup(r, WORLD)), "weight", w.T.contiguous())
        for r in range(WORLD)
    ]
    assert torch.equal(torch.cat(rows, 1), w.T)
    x = torch.randn(3, 8)  # the row-parallel partial products sum to the full matmul
    torch.testing.assert_close(
        sum(x[:, 4 * r : 4 * r + 4] @ rows[r].T for r in range(WORLD)), x @ w
    )


def test_merged_gate_up_slices():
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for r in range(WORLD):
        layer = MergedColumnParallelLinear(4, [8, 8], tp=TPGroup(r, WORLD))
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        assert torch.equal(
            layer.weight, torch.cat([gate[4 * r : 4 * r + 4], up[4 * r : 4 * r + 4]])
        )


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_qkv_slices_split_or_replicate_kv_heads(kv_heads):
    d, heads = 3, 4
    q, k, v = torch.randn(heads * d, 5), torch.randn(kv_heads * d, 5), torch.randn(kv_heads * d, 5)
    for r in range(WORLD):
        layer = QKVParallelLinear(5, d, heads, kv_heads, tp=TPGroup(r, WORLD))
        for shard, w in (("q", q), ("k", k), ("v", v)):
            _load(layer, "weight", w, shard)
        kv = r if kv_heads == WORLD else 0  # one KV head replicated on both ranks
        expect = torch.cat(
            [q[2 * d * r : 2 * d * (r + 1)], k[kv * d : (kv + 1) * d], v[kv * d : (kv + 1) * d]]
        )
        assert torch.equal(layer.weight, expect)
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(5, d, 3, 1, tp=TPGroup(0, WORLD))


def test_vocab_parallel_embedding_pads_the_last_rank():
    w = torch.randn(7, 3)
    parts = [
        _load(VocabParallelEmbedding(7, 3, TPGroup(r, WORLD)), "weight", w) for r in range(WORLD)
    ]
    assert torch.equal(torch.cat(parts)[:7], w) and torch.all(parts[1][3] == 0)
    head = ParallelLMHead(7, 3)
    _load(head, "weight", w)
    h = torch.randn(2, 3)
    torch.testing.assert_close(head.compute_logits(h), h @ w.T)


def test_fused_moe_expert_slices():
    gate, up, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    for r in range(WORLD):
        moe = FusedMoE(num_experts=2, hidden_size=4, intermediate_size=8, tp=TPGroup(r, WORLD))
        _load(moe, "w13_weight", gate, (1, "gate"))
        _load(moe, "w13_weight", up, (1, "up"))
        _load(moe, "w2_weight", down, (1, "down"))
        sl = slice(4 * r, 4 * r + 4)
        assert torch.equal(moe.w13_weight[1], torch.cat([gate[sl], up[sl]]))
        assert torch.equal(moe.w2_weight[1], down[:, sl])
        fused = FusedMoE(2, 4, 8, TPGroup(r, WORLD))
        _load(fused, "w13_weight", torch.stack([torch.cat([gate, up])] * 2), (None, "gate_up"))
        assert torch.equal(fused.w13_weight[1], moe.w13_weight[1])
