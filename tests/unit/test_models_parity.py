"""Our model modules against Hugging Face transformers (float32): logits and MoE routing."""

from __future__ import annotations

import pytest
import torch
from raylane.actors.models import load_model
from raylane.kernels.attention.builder import SeqSlice, build_metadata

from tests.tiny_models import (
    attach_kv_cache,
    make_deepseek_v2,
    make_deepseek_v3,
    make_deepseek_v32,
    make_gemma3,
    make_glm4_moe,
    make_glm_moe_dsa,
    make_gpt_oss,
    make_llama,
    make_mixtral,
    make_qwen2,
    make_qwen3,
    make_qwen3_moe,
    run_prefill,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}

VARIANTS = {
    "llama": (make_llama, {}),
    "llama_tied_llama3_hd32": (
        make_llama,
        {"tie_word_embeddings": True, "head_dim": 32, "rope_scaling": LLAMA3_ROPE},
    ),
    "llama_bias_mha": (
        make_llama,
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4, "rope_theta": 500.0},
    ),
    "qwen2": (make_qwen2, {}),
    "qwen3": (make_qwen3, {}),
    "qwen3_moe": (make_qwen3_moe, {}),
    "mixtral": (make_mixtral, {}),
    "qwen3_moe_sparse_step": (
        make_qwen3_moe,
        {"decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False},
    ),
    "deepseek_v3": (make_deepseek_v3, {}),
    "glm4_moe": (make_glm4_moe, {}),
    "deepseek_v32": (make_deepseek_v32, {}),
    "glm_moe_dsa": (make_glm_moe_dsa, {}),
    "deepseek_v2": (make_deepseek_v2, {}),
    "gemma3": (make_gemma3, {}),
    "gpt_oss": (make_gpt_oss, {}),
    "gemma3_tied_softcap": (
        make_gemma3,
        {"tie_word_embeddings": True, "final_logit_softcapping": 3.0},
    ),
    "deepseek_v2_lite_greedy": (make_deepseek_v2, {"q_lora_rank": None, "topk_method": "greedy"}),
    # no low-rank query, rotate-half rope with YaRN (softmax mscale), biases, no renormalise
    "deepseek_v3_q_proj_yarn": (
        make_deepseek_v3,
        {
            "q_lora_rank": None,
            "rope_interleave": False,
            "attention_bias": True,
            "norm_topk_prob": False,
            "rope_parameters": DEEPSEEK_YARN,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(our model, HF model, HF router top-k picks per forward) for one variant."""
    from transformers import AutoModelForCausalLM

    make, overrides = VARIANTS[request.param]
    path = make(tmp_path_factory.mktemp(request.param), **overrides)
    ours, _, _ = load_model(path, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    picks: list[torch.Tensor] = []
    for module in hf.modules():
        if (
            type(module).__name__.lower().endswith("topkrouter")
        ):  # returns (logits, scores, indices)
            module.register_forward_hook(lambda mod, args, out: picks.append(out[2]))
    return ours, hf, picks


def _prompt(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_forward(hf, picks: list[torch.Tensor], ids: list[int]):
    picks.clear()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]  # [T, V]
    routed = torch.stack(picks, dim=1) if picks else None  # [T, L_moe, k]
    return logits, routed


def test_prompt_logits_and_routing_match_hf(variant):
    ours, hf, picks = variant
    ids = _prompt()
    ref, ref_routed = _hf_forward(hf, picks, ids)
    attach_kv_cache(ours, 64)
    logits, routed = run_prefill(ours, ids)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    if ref_routed is None:
        assert routed is None and ours.num_moe_layers == 0 and ours.moe_top_k == 0
        return
    assert routed.dtype == torch.int32
    assert routed.shape == (len(ids), ours.num_moe_layers, ours.moe_top_k)
    assert torch.equal(routed.long(), ref_routed)


def test_two_chunk_prefill_reuses_kv_cache(variant):
    ours, hf, picks = variant
    ids = _prompt(seed=1)
    ref, ref_routed = _hf_forward(hf, picks, ids)
    attach_kv_cache(ours, 64)
    run_prefill(ours, ids[:20])
    logits, routed = run_prefill(ours, ids, start=20)  # context 40, 20 new tokens
    torch.testing.assert_close(logits, ref[20:], atol=1e-4, rtol=0)
    if ref_routed is not None:
        assert torch.equal(routed.long(), ref_routed[20:])


def test_mixed_prefill_and_decode_batch(variant):
    """Two sequences in one step: A prefills 37 tokens, B decodes its 26th token."""
    ours, hf, picks = variant
    a, b = _prompt(37, seed=2), _prompt(26, seed=3)
    ref_a, _ = _hf_forward(hf, picks, a)
    ref_b, _ = _hf_forward(hf, picks, b)
    attach_kv_cache(ours, 8 * 16)
    table_a, table_b = [5, 1, 7], [2, 4]  # scattered blocks
    first = build_metadata([SeqSlice(25, 25, table_b)], [], 16)
    with torch.no_grad():
        ours(torch.tensor(b[:25]), torch.arange(25), first)
        meta = build_metadata([SeqSlice(37, 37, table_a)], [SeqSlice(1, 26, table_b)], 16)
        ids = torch.tensor(a + b[25:])
        positions = torch.cat([torch.arange(37), torch.tensor([25])])
        hidden, _ = ours(ids, positions, meta)
        logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits[:37], ref_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[37], ref_b[25], atol=1e-4, rtol=0)
