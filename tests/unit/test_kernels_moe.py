"""MoE routing and expert compute vs HF Qwen3-MoE and a direct per-token computation; the
expert compute never reads a tensor on the host (CUDA-graph capturable)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.moe import expert_forward, fused_moe, select_experts

E, H, INTER, K = 6, 16, 8, 2


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, 2 * INTER, H, generator=gen) * 0.3,
        torch.randn(E, H, INTER, generator=gen) * 0.3,
        torch.randn(E, H, generator=gen),
    )


def _direct(x, w13, w2, weights, ids):
    """One token at a time, one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (w13[ids[t, j]] @ x[t]).split(INTER)
            out[t] += weights[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_and_output_equal_hf_sparse_moe_block(renormalize, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=renormalize,
    )
    block = Qwen3MoeSparseMoeBlock(config).eval().to(dtype)  # HF's per-expert loop
    w13, w2, router = (w.to(dtype) for w in _weights())
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        block.gate.weight.copy_(router)
    x = torch.randn(1, 11, H, dtype=dtype)
    with torch.no_grad():
        ref = block(x)[0]
        _, ref_scores, ref_ids = block.gate(x[0])
    out, ids = fused_moe(x[0], F.linear(x[0], router), w13, w2, K, renormalize)
    assert ids.dtype == torch.int32 and ids.shape == (11, K)
    assert torch.equal(ids.long(), ref_ids)
    # bit for bit: the same matmuls on the same rows in the same order, the same additions
    assert torch.equal(out, ref)
    weights, _ = select_experts(F.linear(x[0], router), K, renormalize)
    torch.testing.assert_close(weights, ref_scores)


def test_expert_forward_equals_direct_per_token_computation():
    w13, w2, router = _weights(1)
    x = torch.randn(9, H)
    weights, ids = select_experts(F.linear(x, router), K, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    torch.testing.assert_close(
        expert_forward(x, w13, w2, weights, ids),
        _direct(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_unused_experts_and_single_token():
    w13, w2, _ = _weights(2)
    x = torch.randn(1, H)
    ids = torch.tensor([[4, 1]])  # experts 0, 2, 3, 5 get no tokens
    weights = torch.tensor([[0.75, 0.25]])
    torch.testing.assert_close(
        expert_forward(x, w13, w2, weights, ids),
        _direct(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_selection_is_softmax_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, probs[:, [1, 3]])


def _naive(x, w13, w2, weights, ids):
    """Float64, one token and one chosen expert at a time."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def _routing(case: str, gen: torch.Generator) -> torch.Tensor:
    """ids [T, k] for one routing pattern over E experts."""
    if case == "spread":
        return torch.rand(13, E, generator=gen).topk(3, dim=-1).indices
    if case == "idle_experts":  # experts 0, 2, 3, 5 get no tokens
        return torch.tensor([[4, 1], [1, 4], [4, 1], [1, 4], [1, 4]])
    if case == "all_on_one":  # one group of every row, the rest empty
        return torch.full((7, 1), 3)
    assert case == "single_token"
    return torch.tensor([[5, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inter", [(16, 8), (10, 5)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("case", ["spread", "idle_experts", "all_on_one", "single_token"])
def test_expert_forward_equals_naive_float64(dtype, hidden, inter, case, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    ids = _routing(case, gen)
    num_tokens, top_k = ids.shape
    weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(E, hidden, inter, generator=gen) * 0.3).to(dtype)
    grouped_calls = []
    grouped_mm = torch._grouped_mm

    def counted(*args, **kwargs):
        grouped_calls.append(args[1].shape)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)

    out = expert_forward(x, w13, w2, weights, ids)

    # 16-byte strides: 4 float32 or 8 bfloat16 elements; (10, 5) meets neither
    assert len(grouped_calls) == (2 if hidden == 16 else 0)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), _naive(x, w13, w2, weights, ids), atol=tol, rtol=tol)


@contextlib.contextmanager
def _no_host_sync(monkeypatch: pytest.MonkeyPatch):
    """Any read of a tensor's value on the host (what would stall a CUDA stream and break graph
    capture) raises. Covers Python-level reads only, not syncs inside C++ ops."""

    def refuse(name: str):
        def read(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}")

        return read

    with monkeypatch.context() as patch:
        for name in (
            "tolist",
            "item",
            "cpu",
            "numpy",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
        ):
            patch.setattr(torch.Tensor, name, refuse(name))
        yield


def test_no_host_sync_guard_catches_reads(monkeypatch):
    counts = torch.bincount(torch.tensor([0, 2, 2]))
    with _no_host_sync(monkeypatch):
        for read in (
            counts.tolist,
            counts[0].item,
            counts.cpu,
            lambda: bool(counts[0]),
            lambda: int(counts[0]),
            lambda: range(counts[0]),
        ):
            with pytest.raises(AssertionError, match="host sync"):
                read()
    assert counts.tolist() == [1, 0, 2]  # restored


@pytest.mark.parametrize("hidden, inter", [(16, 8), (10, 5)], ids=["aligned", "unaligned"])
def test_moe_forward_does_not_sync_with_the_host(hidden, inter, monkeypatch):
    from raylane.actors.models.qwen3_moe import SparseMoeBlock

    block = SparseMoeBlock(hidden, inter, E, K, renormalize=True, hidden_act="silu")
    gen = torch.Generator().manual_seed(4)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(6, hidden, generator=gen)
    with _no_host_sync(monkeypatch), torch.no_grad():
        out, ids = block(x)
    weights, _ = select_experts(F.linear(x, block.gate.weight), K, renormalize=True)
    ref = _naive(x, block.experts.w13_weight, block.experts.w2_weight, weights, ids.long())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_routing_equals_hf_deepseek_v3_router(renormalize):
    from raylane.kernels.moe import select_experts_grouped
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=renormalize,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, H, generator=gen))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(16, generator=gen))
    x = torch.randn(23, H, generator=gen)
    with torch.no_grad():
        logits, ref_weights, ref_ids = router(x)
    weights, ids = select_experts_grouped(
        logits, router.e_score_correction_bias, 3, 4, 2, renormalize, 2.5
    )
    # the chosen sets agree; so do the weights, matched by expert
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))
    # only experts of the two chosen groups (of four experts each), never of the others
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)
