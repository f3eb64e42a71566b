"""RoPE against transformers: inverse frequencies per rope type, the cos/sin cache, rotation."""

from __future__ import annotations

import pytest
import torch
from raylane.kernels.rotary import (
    RotaryEmbedding,
    apply_rotary,
    compute_inv_freq,
    rope_parameters_of,
)

ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
}


def _hf_config(scaling):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=1024,
        rope_theta=50000.0,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_cos_sin_equal_hf_rotary_embedding(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(ROPE_SCALINGS[name])
    hf = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(64, rope_parameters_of(config), config.max_position_embeddings)
    positions = torch.tensor([0, 1, 7, 100, 511, 1023])
    ref_cos, ref_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours(positions)
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_inv_freq_equal_hf_init_functions(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(ROPE_SCALINGS[name])
    params = rope_parameters_of(config)
    inv_freq, scaling = compute_inv_freq(64, params, config.max_position_embeddings)
    if params["rope_type"] == "default":
        ref = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
        ref_scaling = 1.0
    else:
        ref, ref_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    torch.testing.assert_close(inv_freq, ref, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(ref_scaling, rel=1e-9)


def test_apply_rotary_equals_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    cos, sin = RotaryEmbedding(16, {"rope_theta": 10000.0}, 64)(torch.tensor([3, 0, 9, 9, 63]))
    # HF layout: [batch, heads, T, D] with cos/sin [batch, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))


def test_rotation_preserves_norm_and_position_zero_is_identity():
    x = torch.randn(3, 2, 8)
    cos, sin = RotaryEmbedding(8, {"rope_theta": 100.0}, 16)(torch.tensor([0, 5, 15]))
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_legacy_rope_scaling_dict_and_unsupported_types():
    from types import SimpleNamespace

    # transformers 4 style: rope_scaling + rope_theta, no rope_parameters
    v4_config = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1000.0)
    params = rope_parameters_of(v4_config)
    inv_freq, _ = compute_inv_freq(8, params, 64)
    base, _ = compute_inv_freq(8, {"rope_theta": 1000.0}, 64)
    torch.testing.assert_close(inv_freq, base / 2.0)
    with pytest.raises(ValueError, match="rope_type"):
        compute_inv_freq(8, {"rope_type": "longrope", "rope_theta": 1.0}, 64)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        compute_inv_freq(8, {"rope_theta": 1.0, "partial_rotary_factor": 0.5}, 64)
