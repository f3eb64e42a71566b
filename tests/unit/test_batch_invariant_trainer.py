"""The trainer's forward under `raylane.batch_invariant()` equals the engine's rollout bit for bit.

The engine (`EngineConfig(batch_invariant=True)`, raylane's own model code) samples rollouts in
one mixed batch; transformers' own model class, loaded from the same checkpoint in the same
dtype, scores the same tokens teacher-forced with right padding at trainer batch sizes 1, 3 and
all. Logprobs are compared with ==. Outside the context the same forward differs (the property
is not trivially true), and leaving the context restores every op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane import EngineConfig, LLMEngine, SamplingParams, batch_invariant
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tests.tiny_models import (
    make_deepseek_v2,
    make_gemma3,
    make_gpt_oss,
    make_qwen3_5,
    make_qwen3_5_moe,
    make_qwen3_next,
)

DTYPES = ["float32", "bfloat16"]
# Gemma 3: sliding (window 8) and full layers, GELU-tanh, the rollouts longer than the window;
# Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet layers (transformers' chunked scan and
# conv swapped for the engine's token-by-token recurrence) beside gated full attention;
# DeepSeek-V3.2 / GLM-5 (shared indexers): DSA, the rollouts longer than index_topk;
# DeepSeek-V2: its complex-number RoPE rotated as the engine (and DeepSeek-V3) rotates;
# gpt-oss (no "sdpa" in transformers): the same with attention sinks, and biased experts with
# gate and up interleaved
FAMILIES = [
    "tiny_llama_dir",
    "tiny_qwen3_dir",
    "tiny_moe_dir",
    "tiny_deepseek_dir",
    "tiny_gemma3_dir",
    "tiny_qwen3_5_dir",
    "tiny_qwen3_5_moe_dir",
    "tiny_qwen3_next_dir",
    "tiny_dsa_dir",
    "tiny_glm5_dir",
    "tiny_deepseek_v2_dir",
    "tiny_deepseek_v2_yarn_dir",
]
# gpt-oss's norm weights drawn around 1 too: its RMSNorm applies the weight before the cast
EAGER = ["tiny_llama_dir", "tiny_gpt_oss_dir", "tiny_gpt_oss_drawn_norms_dir"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]


def _tiny(make, **overrides):
    """A module-scoped fixture: the tiny checkpoint `make` writes."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
        return make(tmp_path_factory.mktemp(f"bi_trainer_{make.__name__}"), **overrides)

    return model_dir


def drawn_norms(make):
    """`make`, then its RMSNorm weights drawn around 1: transformers initialises them to 1,
    which would hide how a norm applies its weight (measured: gpt-oss's weight-before-cast
    and Llama's cast-then-weight agree at 1, differ by 0.25 in bfloat16 logprobs otherwise)."""

    def made(path, **overrides) -> str:
        model_dir = make(path, **overrides)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(model_dir)
        return model_dir

    made.__name__ = make.__name__
    return made


tiny_deepseek_v2_dir = _tiny(make_deepseek_v2)
# DeepSeek-V2's own RoPE: YaRN with mscale (attention_scaling on cos and sin, and the softmax's)
V2_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "mscale": 0.707}
V2_YARN |= {"mscale_all_dim": 0.707, "original_max_position_embeddings": 64}
V2_YARN |= {"beta_fast": 32.0, "beta_slow": 1.0}
tiny_deepseek_v2_yarn_dir = _tiny(make_deepseek_v2, rope_parameters=V2_YARN)
tiny_gemma3_dir = _tiny(make_gemma3)
tiny_gpt_oss_dir = _tiny(make_gpt_oss)
tiny_gpt_oss_drawn_norms_dir = _tiny(drawn_norms(make_gpt_oss))
tiny_qwen3_5_dir = _tiny(make_qwen3_5)
tiny_qwen3_5_moe_dir = _tiny(make_qwen3_5_moe)
tiny_qwen3_next_dir = _tiny(make_qwen3_next)


def _rollouts(model_dir: str, dtype: str, max_tokens: int = 20):
    engine = LLMEngine(
        EngineConfig(model=model_dir, dtype=dtype, num_kv_blocks=128, batch_invariant=True)
    )
    try:
        params = [
            SamplingParams(seed=3 + i, max_tokens=max_tokens - 3 * i, logprobs=0, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        return engine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.shutdown()


def _padded(outs) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def _trainer_logprobs(hf, ids, mask, batch: int) -> list[list[float]]:
    rows = []
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            part = slice(start, start + batch)
            rows += batch_invariant.logprobs(hf, ids[part], mask[part]).tolist()
    return rows


def _sampled(outs, rows: list[list[float]]) -> list[list[float]]:
    """Each rollout's entries of the trainer's [T - 1] rows: its generated tokens'."""
    got = []
    for o, row in zip(outs, rows):
        n0, n = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
        got.append(row[n0 - 1 : n0 - 1 + n])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "family, attn", [(f, "sdpa") for f in FAMILIES] + [(f, "eager") for f in EAGER]
)
def test_trainer_logprobs_equal_the_rollouts(request, family, dtype, attn):
    model_dir = request.getfixturevalue(family)
    outs = _rollouts(model_dir, dtype)
    want = [o.outputs[0].logprobs for o in outs]
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
    ).eval()
    ids, mask = _padded(outs)
    for batch in (1, 3, len(outs)):
        assert _sampled(outs, _trainer_logprobs(hf, ids, mask, batch)) == want, batch
    with torch.no_grad():  # outside the context: transformers' own kernels, not equal
        lp = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    plain = _sampled(outs, lp.gather(-1, ids[:, 1:, None])[..., 0].tolist())
    assert plain != want


def test_smollm2_bfloat16_is_bitwise_on_policy(smollm2_dir):
    """The embedded real model: its activations are where a GEMV rounds otherwise than a GEMM
    (random tiny models hide some of that)."""
    outs = _rollouts(smollm2_dir, "bfloat16", max_tokens=12)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    ids, mask = _padded(outs)
    for batch in (1, len(outs)):
        got = _sampled(outs, _trainer_logprobs(hf, ids, mask, batch))
        assert got == [o.outputs[0].logprobs for o in outs]


def test_autograd_works_inside_and_agrees_with_outside(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])

    def grads() -> dict[str, torch.Tensor]:
        hf.zero_grad()
        logits = hf(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(lp * mask[:, 1:]).sum()).backward()
        return {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    outside = grads()
    with batch_invariant():
        inside = grads()
    assert inside.keys() == outside.keys() and len(inside) > 5
    for name, g in inside.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, outside[name], rtol=1e-4, atol=1e-5, msg=name)


def _grads(hf, ids, mask) -> dict[str, torch.Tensor]:
    hf.zero_grad()
    logits = hf(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(lp * mask[:, 1:]).sum()).backward()
    return {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["tiny_gpt_oss_dir", "tiny_qwen3_5_dir", "tiny_dsa_dir"])
def test_autograd_through_sinks_gated_deltanet_and_dsa(request, family):
    """gpt-oss's sinks, Qwen3.5's Gated DeltaNet (conv, decay, the recurrence) and DSA's sparse
    attention (20 tokens: past index_topk) get gradients inside the context, within float
    tolerance of transformers' own, relative to each parameter's largest gradient (measured:
    Qwen3.5's recurrence 7e-5 against the chunked scan, both ~3e-4 off float64; the others
    ~5e-6)."""
    hf = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(family), dtype=torch.float32)
    ids = torch.arange(5, 45).view(2, 20)
    mask = (torch.arange(20) < torch.tensor([[20], [9]])).long()
    ids = ids * mask
    outside = _grads(hf, ids, mask)
    with batch_invariant():
        inside = _grads(hf, ids, mask)
    assert inside.keys() == outside.keys()
    wanted = {
        "tiny_gpt_oss_dir": ("sinks",),
        "tiny_qwen3_5_dir": ("conv1d", "A_log", "dt_bias"),
        "tiny_dsa_dir": ("kv_b_proj", "q_b_proj"),
    }[family]
    assert all(any(w in name for name in inside) for w in wanted)
    for name, g in inside.items():
        assert torch.isfinite(g).all(), name
        scale = float(outside[name].abs().max())
        torch.testing.assert_close(g, outside[name], rtol=1e-4, atol=2e-4 * scale, msg=name)


def test_leaving_the_context_restores_every_op():
    tables = (ALL_ATTENTION_FUNCTIONS, ALL_EXPERTS_FUNCTIONS)
    linear, before = F.linear, [dict(t._local_mapping) for t in tables]
    ops = (F.silu, F.gelu, torch.sigmoid, torch.Tensor.sigmoid)
    with pytest.raises(KeyError):
        with batch_invariant():
            assert F.linear is not linear
            assert (
                ALL_ATTENTION_FUNCTIONS["sdpa"]
                is not ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
            )
            experts = ALL_EXPERTS_FUNCTIONS
            assert all(
                experts[k] is not experts._global_mapping[k] for k in experts._global_mapping
            )
            raise KeyError("a trainer's error inside the block")
    assert F.linear is linear and (F.silu, F.gelu, torch.sigmoid, torch.Tensor.sigmoid) == ops
    assert [dict(t._local_mapping) for t in tables] == before


def test_the_families_functions_are_swapped_and_restored():
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm5
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    names = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
    owners = [(m, n) for m in (qwen3_5, qwen3_next) for n in names]
    owners += [(v32.DeepseekV32Attention, "forward"), (glm5.GlmMoeDsaAttention, "forward")]
    owners += [(v2.DeepseekV2RotaryEmbedding, "forward"), (v2, "apply_rotary_emb")]
    owners.append((F, "softplus"))
    before = {(m, n): getattr(m, n) for m, n in owners}
    with batch_invariant():
        assert all(getattr(m, n) is not fn for (m, n), fn in before.items())
    assert all(getattr(m, n) is fn for (m, n), fn in before.items())


def test_left_padding_is_refused_with_what_to_do(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right padding"):
        batch_invariant.logprobs(hf, ids, mask)
