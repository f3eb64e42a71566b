"""oneDNN-packed linear weights: same outputs as F.linear, refreshed when weights change."""

from __future__ import annotations

import pytest
import torch
from raylane.actors.models import load_model, load_weights
from raylane.actors.models.loader import iter_checkpoint
from raylane.actors.models.packing import pack_linear_weights, reorder_supported

from tests.tiny_models import attach_kv_cache, make_llama, run_prefill

IDS = list(range(3, 45))


def _logits(model) -> torch.Tensor:
    attach_kv_cache(model, 48)
    return run_prefill(model, IDS)[0]


def test_packed_model_matches_unpacked(tiny_qwen3_dir):
    packed, _, _ = load_model(tiny_qwen3_dir, "float32")
    plain, _, _ = load_model(tiny_qwen3_dir, "float32", pack_weights=False)
    if not reorder_supported(torch.float32):
        pytest.skip("no oneDNN: nothing is packed")
    assert packed.lm_head.packed is not None
    assert packed.model.layers[0].mlp.down_proj.packed is not None
    assert plain.lm_head.packed is None
    torch.testing.assert_close(_logits(packed), _logits(plain), atol=1e-5, rtol=0)


def test_weight_update_refreshes_packed_copies(tiny_llama_dir, tmp_path):
    other = make_llama(tmp_path, seed=7)
    model, _, _ = load_model(tiny_llama_dir, "float32")
    load_weights(model, iter_checkpoint(other))  # e.g. an RL weight sync
    fresh, _, _ = load_model(other, "float32", pack_weights=False)
    torch.testing.assert_close(_logits(model), _logits(fresh), atol=1e-5, rtol=0)


def test_bfloat16_packed_model_matches_unpacked(tiny_qwen3_dir):
    packed, _, _ = load_model(tiny_qwen3_dir, "bfloat16")
    plain, _, _ = load_model(tiny_qwen3_dir, "bfloat16", pack_weights=False)
    if not reorder_supported(torch.bfloat16):
        pytest.skip("this CPU's oneDNN cannot pack bfloat16 (no avx512bw/vl/dq)")
    assert packed.lm_head.packed is not None and plain.lm_head.packed is None
    assert packed.lm_head.packed.dtype == torch.bfloat16
    # both accumulate in float32 and round each linear's output to bfloat16; a rounding that
    # differs by one bf16 ulp (2**-8 relative) in one layer moves the logits by about that much
    torch.testing.assert_close(_logits(packed), _logits(plain), atol=3e-2, rtol=1e-2)


def test_float16_weights_are_not_packed(tiny_llama_dir):
    model, _, _ = load_model(tiny_llama_dir, "float16")
    assert pack_linear_weights(model) == 0 and model.lm_head.packed is None
