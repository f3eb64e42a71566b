"""RMSNorm (plain and fused with the residual add) and the gated activation, vs HF / direct math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.activation import SiluAndMul, act_and_mul
from raylane.kernels.norm import RMSNorm, rms_norm


def test_rms_norm_equals_hf_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(7, 32) * 3
    hf = LlamaRMSNorm(32, eps=1e-5)
    ours = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(hf.weight)
    assert torch.equal(ours(x), hf(x))


def test_rms_norm_direct_formula_and_bfloat16_input():
    x, w = torch.randn(4, 16), torch.rand(16)
    direct = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6), direct)
    out = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), direct, atol=3e-2, rtol=3e-2)


def test_fused_residual_add_returns_norm_of_sum_and_the_sum():
    norm = RMSNorm(16)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, norm(x + residual))


def test_silu_and_mul_on_fused_gate_up():
    gate, up = torch.randn(5, 12), torch.randn(5, 12)
    fused = torch.cat([gate, up], dim=-1)
    torch.testing.assert_close(SiluAndMul()(fused), F.silu(gate) * up)
    torch.testing.assert_close(act_and_mul(fused, "gelu"), F.gelu(gate) * up)


def test_unknown_activation_is_a_value_error():
    with pytest.raises(ValueError, match="hidden_act"):
        SiluAndMul("relu6")
