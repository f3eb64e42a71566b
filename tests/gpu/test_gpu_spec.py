"""Speculative decoding on CUDA changes no token: n-gram, suffix, draft-model and MTP drafts
against the same engine on CUDA without speculation (greedy ids, logprobs, top logprobs and
kept mass), with the drafts verified and some accepted, so both paths ran."""

from __future__ import annotations

import pytest
from raylane.actors.engine import SamplingParams

from tests.gpu.device import needs_device
from tests.gpu.test_gpu_parity import engine_for
from tests.tiny_models import VOCAB_SIZE
from tests.unit.async_helpers import prompts_for
from tests.unit.spec.helpers import make_loopy_llama
from tests.unit.spec.test_parity import assert_same
from tests.unit.test_mtp_layers import make_deepseek_v3_with_mtp

pytestmark = needs_device

K = 4
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K},  # the target itself
}
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3, return_kept_mass=True
)


def run(model_dir: str, spec: dict | None, prompts, enforce_eager: bool | None = None, **kw):
    kw.setdefault("max_num_seqs", 8)
    engine = engine_for(model_dir, enforce_eager, speculative_config=spec, **kw)
    try:
        return engine.generate(prompts, PARAMS, use_tqdm=False), engine.stats
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("loopy") / "model")


@pytest.mark.parametrize("method", list(SPECS))
def test_spec_changes_no_token(loopy_dir, method):
    spec = {**SPECS[method], "adaptive": False}
    if method == "draft_model":
        spec["model"] = loopy_dir
    prompts = prompts_for(VOCAB_SIZE, (9, 17, 30, 45))
    ref, _ = run(loopy_dir, None, prompts)
    out, stats = run(loopy_dir, spec, prompts)
    assert_same(ref, out)
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


def test_mtp_changes_no_token(tmp_path_factory):
    path = make_deepseek_v3_with_mtp(tmp_path_factory.mktemp("ds_mtp"))[0]
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    prompts = prompts_for(VOCAB_SIZE, (9, 17, 30))
    ref, _ = run(path, None, prompts, max_num_batched_tokens=16)
    out, stats = run(path, spec, prompts, max_num_batched_tokens=16)
    assert_same(ref, out)
    assert stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_linear_attention_spec_changes_no_token(tmp_path_factory, method):
    """Qwen3.5 (Gated DeltaNet layers; the Triton linear-attention backend on CUDA): verify
    rows leave only accepted tokens in the recurrent state; MTP from the checkpoint's mtp.*."""
    from tests.tiny_models import make_qwen3_5
    from tests.unit.spec.helpers import make_loopy
    from tests.unit.spec.test_qwen_mtp import add_mtp

    path = add_mtp(make_loopy(make_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))))
    spec = {**SPECS["ngram"], "adaptive": False} if method == "ngram" else None
    if method == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    base = prompts_for(VOCAB_SIZE, (9, 17, 30))
    first, _ = run(path, None, base)
    prompts = [p + o.outputs[0].token_ids[:24] + p for p, o in zip(base, first)]  # echoes
    ref, _ = run(path, None, prompts)
    out, stats = run(path, spec, prompts)
    assert_same(ref, out)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_verify_graphs_change_no_token(loopy_dir):
    """n-gram verify steps replayed from CUDA graphs of rows x (1 + k) tokens (rows 1, 2, 4
    at k = 4 under sizes up to 20): greedy tokens and logprobs equal eager speculation's and
    no speculation's, and the engine counted verify replays."""
    spec = {**SPECS["ngram"], "adaptive": False}
    prompts = prompts_for(VOCAB_SIZE, (9, 17, 30, 45))
    kw = {"cudagraph_capture_sizes": (1, 2, 4, 8, 16, 20), "max_num_seqs": 20}
    ref, _ = run(loopy_dir, None, prompts, enforce_eager=True, **kw)
    eager, _ = run(loopy_dir, spec, prompts, enforce_eager=True, **kw)
    graphs, stats = run(loopy_dir, spec, prompts, enforce_eager=False, **kw)
    assert_same(ref, eager)
    assert_same(ref, graphs)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert 0 < stats.verify_graph_replays < stats.graph_replays
