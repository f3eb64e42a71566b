"""MoE routing and expert compute vs HF Qwen3-MoE and a direct per-token computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import expert_forward, fused_moe, select_experts

E, H, INTER, K = 6, 16, 8, 2


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * INTER, H, generator=gen) * 0.3,
            torch.randn(E, H, INTER, generator=gen) * 0.3,
            torch.randn(E, H, generator=gen))


def _direct(x, w13, w2, weights, ids):
    """One token at a time, one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (w13[ids[t, j]] @ x[t]).split(INTER)
            out[t] += weights[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_and_output_equal_hf_sparse_moe_block(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=renormalize)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    w13, w2, router = _weights()
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        block.gate.weight.copy_(router)
    x = torch.randn(1, 11, H)
    with torch.no_grad():
        ref = block(x)[0]
        _, ref_scores, ref_ids = block.gate(x[0])
    out, ids = fused_moe(x[0], F.linear(x[0], router), w13, w2, K, renormalize)
    assert ids.dtype == torch.int32 and ids.shape == (11, K)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    weights, _ = select_experts(F.linear(x[0], router), K, renormalize)
    torch.testing.assert_close(weights, ref_scores)


def test_expert_forward_equals_direct_per_token_computation():
    w13, w2, router = _weights(1)
    x = torch.randn(9, H)
    weights, ids = select_experts(F.linear(x, router), K, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    torch.testing.assert_close(expert_forward(x, w13, w2, weights, ids),
                               _direct(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_unused_experts_and_single_token():
    w13, w2, _ = _weights(2)
    x = torch.randn(1, H)
    ids = torch.tensor([[4, 1]])  # experts 0, 2, 3, 5 get no tokens
    weights = torch.tensor([[0.75, 0.25]])
    torch.testing.assert_close(expert_forward(x, w13, w2, weights, ids),
                               _direct(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_selection_is_softmax_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, probs[:, [1, 3]])
