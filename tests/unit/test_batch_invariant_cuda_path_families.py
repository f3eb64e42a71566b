"""The batch-invariant mode's engine on its CUDA path (issue 42) for a DSA model (DeepSeek-V3.2:
MLA with its indexer), end to end without a GPU, its prefill in chunks: with TRITON_INTERPRET=1
and RAYLANE_TRITON_ON_CPU=1 every part that takes a Triton kernel on CUDA takes it on CPU
tensors (the linears, RMSNorms, experts, attention, sampler, and triton_mla.py /
triton_dsa.py). The reference is the engine's own run of each request alone, compared with ==.
Kernel-level checks against float64 math: test_batch_invariant_triton_families.py; on a GPU:
tests/gpu/test_gpu_batch_invariant.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from raylane import EngineConfig, LLMEngine, SamplingParams
from raylane.kernels.attention.registry import TRITON_ON_CPU
from raylane.kernels.batch_invariant.backend import on_triton

from tests import tiny_models as tm
from tests.unit.test_batch_invariant_engine import observed

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter (tests/conftest.py sets it without a GPU)",
)


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRITON_ON_CPU, "1")
    assert on_triton(torch.device("cpu"))


ENGINE_PROMPTS = [[5, 9, 13, 22, 7, 31, 2, 8, 19, 4, 11], [7, 3, 12, 19], [40, 41, 42, 43, 44, 45]]


def _two_layer_model(family: str, path) -> str:
    make = {"deepseek_v32": tm.make_deepseek_v32}[family]
    return make(path, num_hidden_layers=2)  # one dense layer, one MoE


# DeepSeek-V3's MLA and Qwen3.5's Gated DeltaNet alone vs batched (unchunked):
# test_batch_invariant_cuda_path.py, beside their trainer
@pytest.mark.parametrize("family", ["deepseek_v32"])
def test_the_engine_on_the_cuda_path_gives_a_request_its_bits_alone(triton_path, tmp_path, family):
    """A DSA engine in the mode, bfloat16, every kernel the CUDA path's:
    each request's tokens, logprobs and indexer picks (==) alone versus beside the others with
    its prefill cut into chunks of 4 tokens."""
    model = _two_layer_model(family, tmp_path / family)
    params = SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True, temperature=0)
    engine = _engine(model, max_num_batched_tokens=64)
    try:
        alone = [engine.generate([p], [params], use_tqdm=False)[0] for p in ENGINE_PROMPTS]
    finally:
        engine.shutdown()
    engine = _engine(model, max_num_batched_tokens=4)
    try:
        mixed = engine.generate(ENGINE_PROMPTS, [params] * len(ENGINE_PROMPTS), use_tqdm=False)
    finally:
        engine.shutdown()
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert a.outputs[0].finish_reason == "length", a.error
        assert observed(m) == observed(a), f"{family}: request {i}"


def _engine(model: str, **kw) -> LLMEngine:
    config = EngineConfig(
        model=model, dtype="bfloat16", block_size=4, num_kv_blocks=64, batch_invariant=True,
        enforce_eager=True, **kw,
    )  # fmt: skip
    return LLMEngine(config)
