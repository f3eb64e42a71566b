"""The engine's batch-invariant mode on CUDA (issue 42): the Triton matmul, RMSNorm and one-split
decode attention. A request's tokens and logprobs, compared with ==, are the same run alone
(a batch of one, one prefill chunk, serial, eager) and in mixed batches with chunked prefill
and staggered arrivals, with graphs and without. bfloat16, a tiny Llama.

Not yet run on a GPU when written: the kernels were checked under TRITON_INTERPRET=1 only
(tests/unit/test_batch_invariant_triton.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

from tests.gpu.device import DEVICE, in_gpu_lane, needs_cuda, needs_device
from tests.unit.test_batch_invariant_engine import make_prompts, observed, run


def engine_for(model_dir: str, **kw) -> LLMEngine:
    config = {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 8, **kw}
    return LLMEngine(
        EngineConfig(
            model=model_dir, device=DEVICE, dtype="bfloat16", batch_invariant=True, **config
        )
    )


@needs_device
@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_requests_equal_their_runs_alone_on_cuda(tiny_llama_dir, enforce_eager):
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, temperature=0.0)
    alone = engine_for(
        tiny_llama_dir,
        max_num_seqs=1,
        max_num_batched_tokens=512,
        async_scheduling=False,
        enable_prefix_caching=False,
        enforce_eager=True,
    )
    prompts = make_prompts(alone.validator.vocab_size)
    reference = []
    for prompt in prompts:
        alone.flush_cache()
        reference.append(run(alone, [prompt], params)[0])
    alone.shutdown()
    for out in reference:
        assert all(c.finish_reason == "length" for c in out.outputs), out.error
    for budget in (16, 40):  # chunked prefill beside other rows' decodes
        engine = engine_for(
            tiny_llama_dir, max_num_batched_tokens=budget, enforce_eager=enforce_eager
        )
        try:
            for stagger in (0, 2):
                got = run(engine, prompts, params, stagger)
                for i, (ref, out) in enumerate(zip(reference, got)):
                    assert observed(out) == observed(ref), f"request {i} differs from alone"
        finally:
            engine.shutdown()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_give_a_row_the_same_bits_at_any_row_count_on_cuda(dtype):
    """The matmul (tl.dot on tensor cores, which the interpreter cannot check), RMSNorm and
    log_softmax at real widths: a row alone equals the row inside 3, 17 and 300 rows."""
    from raylane.kernels.batch_invariant.triton_matmul import invariant_matmul
    from raylane.kernels.batch_invariant.triton_rowwise import log_softmax, logsumexp, rms_norm
    from raylane.kernels.norm import rms_norm as torch_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 2048, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(1536, 2048, device="cuda", generator=gen) / 45).to(dtype)
    norm_w = torch.randn(2048, device="cuda", generator=gen).to(dtype)
    ops = {
        "matmul": lambda t: invariant_matmul(t, w),
        "rms_norm": lambda t: rms_norm(t, norm_w, 1e-6),
        "log_softmax": log_softmax,
        "logsumexp": logsumexp,
    }
    for name, op in ops.items():
        full = op(x)
        for m in (1, 3, 17):
            assert torch.equal(op(x[:m]), full[:m]), (name, m)
        assert torch.equal(op(x[150:151])[0], full[150]), name
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    ref = x.double() @ w.double().T
    torch.testing.assert_close(invariant_matmul(x, w).double(), ref, atol=tol * 4, rtol=tol)
    got, want = rms_norm(x, norm_w, 1e-6), torch_rms_norm(x, norm_w, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)
    want = torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(log_softmax(x).double(), want, atol=1e-4, rtol=1e-4)
    want = torch.logsumexp(x.double(), -1)
    torch.testing.assert_close(logsumexp(x).double(), want, atol=1e-4, rtol=1e-4)


@in_gpu_lane
def test_the_gpu_branches_compile_for_sm90():
    """The kernels' CUDA branches (tl.dot, which the interpreter never takes) compiled ahead of
    time for sm_90 with Triton's bundled ptxas, no GPU needed: a subprocess, since a test
    session on the CPU runs Triton in interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.gpu.test_gpu_batch_invariant"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled"] * 10


# both dtypes for the dense and MoE families; bfloat16 for MLA, DSA, Gated DeltaNet, windows
TRAINER_CASES = [(f, d) for f in ("llama", "qwen3", "qwen3_moe") for d in ("bfloat16", "float32")]
TRAINER_CASES += [(f, "bfloat16") for f in ("deepseek_v3", "deepseek_v32", "qwen3_5", "gemma3")]


@needs_device
@pytest.mark.parametrize("family, dtype", TRAINER_CASES)
def test_trainer_logprobs_equal_the_rollouts_on_cuda(tmp_path, family, dtype):
    """`raylane.batch_invariant()` on CUDA (the Triton matmul, RMSNorms, log_softmax, experts,
    one-split decode attention, DSA and the delta rule, as the engine's mode): transformers'
    teacher-forced logprobs of rollouts sampled in one mixed batch equal the engine's (==) at
    trainer batch sizes 1, 3 and all, right padded, with "sdpa" and "eager"; a backward inside
    runs. The norms' weights drawn around 1 (not transformers' 1s). Checked under
    TRITON_INTERPRET=1 only when written (tests/unit/test_batch_invariant_cuda_path.py)."""
    from raylane import batch_invariant
    from transformers import AutoModelForCausalLM

    from tests import tiny_models
    from tests.unit.test_batch_invariant_cuda_path import _drawn_norms
    from tests.unit.test_batch_invariant_trainer import (
        PROMPTS,
        _grads,
        _padded,
        _sampled,
        _trainer_logprobs,
    )

    model_dir = _drawn_norms(getattr(tiny_models, f"make_{family}"))(tmp_path / family)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir, device=DEVICE, dtype=dtype, batch_invariant=True, num_kv_blocks=128
        )
    )
    try:
        params = [
            SamplingParams(seed=3 + i, max_tokens=20 - 3 * i, logprobs=0, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.shutdown()
    want = [o.outputs[0].logprobs for o in outs]
    ids, mask = (t.to(DEVICE) for t in _padded(outs))
    for attn in ("sdpa", "eager"):
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
        )
        hf = hf.to(DEVICE).eval()
        for batch in (1, 3, len(outs)):
            got = _sampled(outs, _trainer_logprobs(hf, ids, mask, batch))
            assert got == want, (attn, batch)
    with batch_invariant():
        grads = _grads(hf.float(), ids, mask)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())


@needs_device
def test_sampler_rows_do_not_follow_the_batch_on_cuda():
    """The mode's sampler on CUDA at a real vocabulary: a row's token, logprobs, top-logprobs
    and kept mass alone equal the row's inside 37 rows (==). The token rests on torch's CUDA
    softmax, sort and the race's block sums, which keep one order per row at this width (their
    launch configs read the row's length, and at 16 or more blocks of 256 the race's sum
    reads no row count): unchecked off a GPU."""
    from raylane.actors.runner.sampler import Sampler

    from tests.unit.test_sampler import make_seq

    device = torch.device(DEVICE)
    sampler = Sampler(49152, [0], device, seed=1, batch_invariant=True)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(37, 49152, device=device, generator=gen) * 4
    kinds = [{"seed": 7, "top_k": 50}, {"temperature": 0}, {"seed": 8, "top_p": 0.9}]

    def states(rows):
        return [make_seq(logprobs=5, return_kept_mass=True, **kinds[i % 3]) for i in rows]

    batched = sampler(logits, states(range(37)))
    for i in (0, 1, 2, 20, 36):
        alone = sampler(logits[i : i + 1], states([i]))
        assert alone.token_ids[0] == batched.token_ids[i], i  # torch's softmax and race sums
        assert alone.logprobs[0] == batched.logprobs[i], i
        assert alone.top_logprobs[0] == batched.top_logprobs[i], i
        assert alone.kept_mass[0] == batched.kept_mass[i], i


def _compile_for_sm90(kernel, pointers: dict[str, str], consts: dict, **options) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    kinds = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    src = ASTSource(kernel, kinds, constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled")


def _compile_all() -> None:
    from raylane.kernels.batch_invariant import triton_experts as te
    from raylane.kernels.batch_invariant import triton_matmul as tm
    from raylane.kernels.batch_invariant import triton_rowwise as tr

    for ty, precision in (("*fp32", "ieee"), ("*bf16", "tf32")):
        tiles = {"BLOCK_M": tm.BLOCK_M, "BLOCK_N": tm.BLOCK_N, "BLOCK_K": tm.BLOCK_K}
        consts = {"HAS_BIAS": True, "INTERPRETED": False, "PRECISION": precision, **tiles}
        pointers = {"x": ty, "w": ty, "bias": ty, "out": ty}
        _compile_for_sm90(tm._matmul_kernel, pointers, consts, num_warps=tm.NUM_WARPS)
        pointers = {"x": ty, "weight": ty, "out": ty, "eps": "fp32"}
        _compile_for_sm90(tr._rms_norm_kernel, pointers, {"BLOCK": tr.BLOCK})
        pointers = {"x": ty, "out": "*fp32"}
        _compile_for_sm90(tr._log_softmax_kernel, pointers, {"BLOCK": tr.BLOCK})
        _compile_for_sm90(tr._logsumexp_kernel, pointers, {"BLOCK": tr.BLOCK})
        pointers = {"a": ty, "w": ty, "out": ty, "expert_of_row": "*i64"}
        consts = {"BLOCK_N": te.BLOCK_N, "BLOCK_K": te.BLOCK_K}
        _compile_for_sm90(te._expert_rows_kernel, pointers, consts)


if __name__ == "__main__":
    _compile_all()


# --- MLA, DSA and Gated DeltaNet (triton_mla.py, triton_dsa.py, triton_gdn.py) ------------------


def _family_models() -> dict:
    from tests import tiny_models as tm

    return {
        "deepseek_v3": tm.make_deepseek_v3,  # MLA, its expanded form as one-split decodes
        "deepseek_v32": tm.make_deepseek_v32,  # DSA: per-token indexer and sparse attention
        "qwen3_5": tm.make_qwen3_5,  # Gated DeltaNet's Triton recurrence, (1 + w) RMSNorms
        "qwen3_next": tm.make_qwen3_next,
    }


@needs_device
@pytest.mark.parametrize("family", sorted(_family_models()))
def test_mla_dsa_and_gated_deltanet_requests_equal_their_runs_alone(tmp_path, family):
    """Each request of a tiny DeepSeek-V3 / V3.2 / Qwen3.5 / Qwen3-Next, bfloat16: tokens,
    logprobs, top-logprobs, routed experts and indexer picks (==) alone versus in mixed
    batches with chunked prefill and staggered arrivals, with graphs and without."""
    model = _family_models()[family](tmp_path / family)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.0)
    reference, prompts = _each_alone(model, params)
    for budget, enforce_eager in ((16, None), (40, True)):
        engine = engine_for(model, max_num_batched_tokens=budget, enforce_eager=enforce_eager)
        try:
            got = run(engine, prompts, params, 2)
            for i, (ref, out) in enumerate(zip(reference, got)):
                assert observed(out) == observed(ref), f"{family}: request {i} differs"
        finally:
            engine.shutdown()


def _each_alone(model: str, params: SamplingParams) -> tuple[list, list[list[int]]]:
    """(each of four prompts' output run alone: serial, eager, no prefix cache; the prompts)."""
    engine = engine_for(
        model, max_num_seqs=1, max_num_batched_tokens=512, async_scheduling=False,
        enable_prefix_caching=False, enforce_eager=True,
    )  # fmt: skip
    try:
        prompts = make_prompts(engine.validator.vocab_size)[:4]
        outs = [engine.generate([p], [params], use_tqdm=False)[0] for p in prompts]
    finally:
        engine.shutdown()
    for out in outs:
        assert all(c.finish_reason == "length" for c in out.outputs), out.error
    return outs, prompts


@in_gpu_lane
def test_the_mla_dsa_and_gated_deltanet_kernels_compile_for_sm90():
    """triton_dsa's and triton_gdn's CUDA branches (tl.dot, the compiled loop) for sm_90, as
    `test_the_gpu_branches_compile_for_sm90` does for the others (a subprocess, no GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import tests.gpu.test_gpu_batch_invariant as t; t._compile_families()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled"] * 6


def _compile_families() -> None:
    from raylane.kernels.batch_invariant import triton_dsa as td
    from raylane.kernels.batch_invariant import triton_gdn as tg

    for ty, precision in (("*fp32", "ieee"), ("*bf16", "tf32")):
        tiles = {"BLOCK_M": td.BLOCK_M, "BLOCK_N": td.BLOCK_N, "BLOCK_K": td.BLOCK_K}
        consts = {"INTERPRETED": False, "PRECISION": precision, **tiles}
        _compile_for_sm90(td._token_matmul_kernel, {"a": ty, "b": ty, "out": ty}, consts)
        tensors = dict.fromkeys(("q", "k", "v", "beta"), ty)
        pointers = {**tensors, "g": "*fp32", "state": "*fp32", "out": "*fp32"}
        pointers |= {"starts": "*i32", "slots": "*i64", "scale": "fp32", "eps": "fp32"}
        for dk, dv in ((128, 128), (16, 8)):  # Qwen3.5's heads; the tiny model's
            consts = {"GROUP": 2, "DK": dk, "DV": dv, "DK_PAD": dk, "L2NORM": True}
            consts["BLOCK_V"] = min(dv, tg.BLOCK_V_MAX)
            _compile_for_sm90(tg._recurrent_kernel, pointers, consts)
