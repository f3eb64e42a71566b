"""The fused elementwise ops (kernels/fused_ops.py): the C kernels against the torch reference
ops and HF's LlamaRMSNorm, their fallbacks, the registry, and tiny models against HF with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane.actors.models import load_model
from raylane.kernels.fused_ops import CpuOps, TorchOps, attach_fused_ops, get_fused_ops

from tests.tiny_models import (
    attach_kv_cache,
    make_gemma3,
    make_llama,
    make_qwen3,
    make_qwen3_5,
    run_prefill,
)

cpu_ops = pytest.fixture(scope="module")(lambda: get_fused_ops("cpu", "cpu"))
REF = TorchOps()
# rows x dim: one element, odd dims, a decode batch, and one large enough to run on all threads
SHAPES = [(1, 1), (7, 33), (32, 576), (5, 1001), (600, 576)]


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 steps (adjacent finite values of one sign)."""
    ia, ib = (t.view(torch.int16).int() for t in (a, b))
    return int(torch.where(a == b, 0, (ia - ib).abs()).max())  # -0 == 0


def _hf_norm(dim: int, weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(dim, eps=eps).to(weight.dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    return hf


@pytest.mark.parametrize("rows,dim", SHAPES)
def test_rms_norm_matches_hf_within_float32_rounding(cpu_ops, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, residual = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    w = torch.rand(dim, generator=g) + 0.5
    hf = _hf_norm(dim, w, 1e-5)
    with torch.no_grad():
        torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5, None), hf(x), rtol=2e-6, atol=1e-6)
        out, new_residual = cpu_ops.rms_norm(x, w, 1e-5, residual)
        assert torch.equal(new_residual, residual + x)  # the add is one float op either way
        torch.testing.assert_close(out, hf(residual + x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,dim", SHAPES)
def test_bf16_rms_norm_matches_the_torch_ops(cpu_ops, rows, dim):
    g = torch.Generator().manual_seed(dim)
    x, residual = (torch.randn(rows, dim, generator=g).bfloat16() for _ in range(2))
    w = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    out, new_residual = cpu_ops.rms_norm(x, w, 1e-6, residual)
    ref_out, ref_residual = REF.rms_norm(x, w, 1e-6, residual)
    assert out.dtype == torch.bfloat16 and torch.equal(new_residual, ref_residual)
    # float32 statistics summed in another order may move each of the two bf16 roundings
    # (normalised row, weight product) by one step
    assert _bf16_ulps(out, ref_out) <= 2
    assert _bf16_ulps(cpu_ops.rms_norm(x, w, 1e-6, None), REF.rms_norm(x, w, 1e-6, None)) <= 2


def test_rms_norm_reads_strided_rows_and_3d_tensors(cpu_ops):
    wide = torch.randn(9, 100)
    x, w = wide[:, 10:50], torch.rand(40)  # rows 100 apart
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6, None), REF.rms_norm(x, w, 1e-6, None))
    x3, r3 = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    out, res = cpu_ops.rms_norm(x3, w, 1e-6, r3)
    ref_out, ref_res = REF.rms_norm(x3, w, 1e-6, r3)
    assert out.shape == (2, 3, 40) and torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 33), (32, 1536), (3, 1001), (200, 1536)])
def test_silu_and_mul_matches_torch(cpu_ops, rows, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 90.0, -200.0])[: min(4, inter)]  # exp's far ends
    gate, up = x[:, :inter], x[:, inter:]
    torch.testing.assert_close(cpu_ops.act_and_mul(x, "silu"), F.silu(gate) * up)
    xb = x.bfloat16()
    assert _bf16_ulps(cpu_ops.act_and_mul(xb, "silu"), REF.act_and_mul(xb, "silu")) <= 1


def test_silu_and_mul_reads_strided_rows(cpu_ops):
    wide = torch.randn(6, 70)
    x = wide[:, 3:63]  # [6, 2 * 30], rows 70 apart
    torch.testing.assert_close(cpu_ops.act_and_mul(x, "silu"), REF.act_and_mul(x, "silu"))


def test_a_rows_values_do_not_depend_on_the_layout_or_the_batch(cpu_ops):
    # qwen3's q/k norms see [T, H, D] views of the qkv output: contiguous only at T = 1. Every
    # layout must take the same code, or a sequence's logprobs change with its batch.
    qkv = torch.randn(5, 3 * 4 * 32)
    heads = qkv[:, : 4 * 32].view(5, 4, 32)  # [T, H, D], rows 32 apart within a token only
    w = torch.rand(32)
    batch = cpu_ops.rms_norm(heads, w, 1e-6, None)
    for t in range(5):
        alone = cpu_ops.rms_norm(qkv[t : t + 1, : 4 * 32].view(1, 4, 32), w, 1e-6, None)
        assert torch.equal(batch[t : t + 1], alone)
    assert torch.equal(batch, cpu_ops.rms_norm(heads.contiguous(), w, 1e-6, None))
    x, r = torch.randn(4, 6, 16).transpose(0, 1), torch.randn(6, 4, 16)
    w16 = torch.rand(16)
    out, res = cpu_ops.rms_norm(x, w16, 1e-6, r)  # a strided 3-D x: the C code, on a copy
    ref_out, ref_res = REF.rms_norm(x, w16, 1e-6, r)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=1e-6)


def _hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on x [T, H, D] (it takes [B, H, T, D] and [B, T, D]): Llama's
    over the whole head, Qwen3-Next's (the leading R dims, the rest passed through) for a
    partial rotary."""
    if cos.shape[-1] == x.shape[-1]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    q = x.transpose(0, 1).unsqueeze(0)
    out, _ = apply_rotary_pos_emb(q, q, cos.unsqueeze(0), sin.unsqueeze(0))
    return out[0].transpose(0, 1)


# tokens x heads x head dim x rotary dims: one token, odd head counts, a decode batch of
# SmolLM2's q + k heads, a prefill large enough to run on all threads, and partial rotaries
# (Qwen3.5's 64 of 256 dims, GLM's half)
ROPE_SHAPES = [
    (1, 1, 2, 2),
    (3, 5, 64, 64),
    (32, 12, 64, 64),
    (7, 3, 128, 128),
    (700, 12, 64, 64),
    (5, 4, 256, 64),
    (9, 3, 64, 32),
    (600, 8, 64, 2),
]


@pytest.mark.parametrize("tokens,heads,dim,rot", ROPE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_hf_bit_for_bit(cpu_ops, tokens, heads, dim, rot, dtype, monkeypatch):
    """Each product and the sum rounded on its own, as HF's three ops: equal, not close. The
    input is a strided slice of a wider row (q and k heads of a fused qkv projection)."""
    g = torch.Generator().manual_seed(tokens * heads + dim + rot)
    qkv = (torch.randn(tokens, heads + 2, dim, generator=g) * 4).to(dtype)
    x = qkv[:, :heads]  # rows (heads + 2) * dim apart
    angles = torch.rand(tokens, rot // 2, generator=g) * 100
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    with monkeypatch.context() as m:  # the C code, not the torch ops it falls back to
        m.setattr(TorchOps, "rotary", lambda *a: pytest.fail("took the torch ops"))
        out = cpu_ops.rotary(x, cos, sin)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, _hf_rotary(x, cos, sin))
    assert torch.equal(out, REF.rotary(x, cos, sin))


def test_what_the_c_code_does_not_serve_takes_the_torch_ops(cpu_ops):
    w = torch.rand(16)
    h = torch.randn(3, 16).half()
    assert torch.equal(
        cpu_ops.rms_norm(h, w.half(), 1e-6, None), REF.rms_norm(h, w.half(), 1e-6, None)
    )
    y = torch.randn(3, 20)
    assert torch.equal(cpu_ops.act_and_mul(y, "gelu"), REF.act_and_mul(y, "gelu"))
    x, cos = torch.randn(4, 3, 16), torch.rand(4, 8)  # float16; an odd rotary width
    assert torch.equal(cpu_ops.rotary(x.half(), cos.half(), cos.half()),
                       REF.rotary(x.half(), cos.half(), cos.half()))  # fmt: skip
    odd = torch.rand(4, 7)
    assert torch.equal(cpu_ops.rotary(x, odd, odd), REF.rotary(x, odd, odd))
    w32 = torch.rand(20)  # a weight in another dtype than x: torch's promotion rules
    assert torch.equal(
        cpu_ops.rms_norm(y.bfloat16(), w32, 1e-6, None), REF.rms_norm(y.bfloat16(), w32, 1e-6, None)
    )


def test_registry_picks_the_c_kernels_on_cpu_only():
    assert get_fused_ops("auto", "cpu").name == "cpu"
    assert get_fused_ops("auto", "meta").name == "torch"
    with pytest.raises(ValueError, match="not available"):
        get_fused_ops("cpu", "meta")
    with pytest.raises(ValueError, match="not available"):
        get_fused_ops("nope", "cpu")


@pytest.mark.parametrize("make", [make_llama, make_qwen3])
def test_tiny_models_with_the_c_kernels_match_hf(tmp_path, make, cpu_ops):
    from transformers import AutoModelForCausalLM

    path = make(tmp_path)
    ours, _, _ = load_model(path, torch.float32, "cpu")
    attach_fused_ops(ours, cpu_ops)
    assert {type(m.ops).__name__ for m in ours.modules() if hasattr(m, "ops")} == {"CpuOps"}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 384, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    attach_kv_cache(ours, 64)
    run_prefill(ours, ids[:30])
    logits, _ = run_prefill(ours, ids, start=30)  # a chunk over a cached prefix
    torch.testing.assert_close(logits, ref[30:], atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), ref[30:].argmax(-1))


@pytest.mark.parametrize("make,partial", [(make_gemma3, False), (make_qwen3_5, True)])
def test_gemma3_and_qwen3_5_rope_runs_in_c_with_the_torch_ops_outputs(
    tmp_path, make, partial, monkeypatch
):
    """Their attention hands RoPE to the runner's fused ops: in the engine every call takes the C
    kernel (Qwen3.5's partial rotary too), and greedy tokens and logprobs equal a run on the
    torch ops exactly (the C kernel rounds as they do; HF parity: test_windowed_models,
    test_hybrid_models)."""
    from tests.unit.test_engine_parity import engine_for, greedy, prompts_for

    path = make(tmp_path)

    def run():
        engine = engine_for(path, max_num_batched_tokens=32)
        try:
            prompts = prompts_for(engine.validator.vocab_size, seed=5, count=3)
            return engine.generate(prompts, greedy(6), use_tqdm=False)
        finally:
            engine.shutdown()

    with monkeypatch.context() as m:
        m.setattr(CpuOps, "rotary", TorchOps.rotary)
        ref = run()
    widths, real = [], CpuOps.rotary

    def spy(self, x, cos, sin):
        widths.append((cos.shape[-1], x.shape[-1]))
        return real(self, x, cos, sin)

    with monkeypatch.context() as m:
        m.setattr(CpuOps, "rotary", spy)
        m.setattr(TorchOps, "rotary", lambda *a: pytest.fail("took the torch ops"))
        got = run()
    assert widths and all((r < d) == partial for r, d in widths)
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].logprobs == r.outputs[0].logprobs
