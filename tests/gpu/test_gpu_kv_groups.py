"""Models mixing sliding and full layers on CUDA, with their KV cache groups: 4-token blocks and
window 8, so the sliding groups free blocks while decode batches replay from CUDA graphs (one
static block table and slot mapping per group) on the Triton backend; greedy ids and raw
logprobs against HF on the same device, and a second run from the prefix cache."""

from __future__ import annotations

import random

import pytest
from raylane.actors.engine import SamplingParams

from tests import tiny_models
from tests.gpu.device import needs_device
from tests.gpu.test_gpu_parity import assert_graphs_used, assert_matches_hf, engine_for

pytestmark = needs_device

SLIDING, FULL = "sliding_attention", "full_attention"
MODELS = {  # name -> (builder, overrides, the KV cache groups' windows)
    "gpt_oss": ("make_gpt_oss", {}, (None, 8)),
    "gemma3_two_full_groups": (  # 5 sliding + 2 full: groups of 1 layer (the gcd)
        "make_gemma3",
        {"num_hidden_layers": 7, "layer_types": [SLIDING, SLIDING, FULL] + [SLIDING] * 3 + [FULL]},
        (None, None, 8, 8, 8, 8, 8),
    ),
    "gemma3_uneven": (  # 5 sliding + 3 full: groups of 3, the last sliding one of 2 layers
        "make_gemma3",
        {
            "num_hidden_layers": 8,
            "layer_types": [SLIDING, SLIDING, FULL] + [SLIDING] * 3 + [FULL] * 2,
        },
        (None, 8, 8),
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_kv_groups_match_hf(name, enforce_eager, tmp_path_factory):
    builder, overrides, windows = MODELS[name]
    model_dir = getattr(tiny_models, builder)(tmp_path_factory.mktemp(name), **overrides)
    kw = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8, "num_kv_blocks": 512}
    engine = engine_for(model_dir, enforce_eager, **kw)
    assert engine.block_manager.windows == windows
    rng, vocab = random.Random(11), engine.validator.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 17, 33, 58)]
    warm = engine_for(model_dir, enforce_eager, **kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    warm.generate(prompts, greedy, use_tqdm=False)  # fills its prefix cache
    assert_matches_hf(model_dir, engine, prompts, 40)
    assert_graphs_used(engine, enforce_eager)
    outs = assert_matches_hf(model_dir, warm, prompts, 40)
    assert warm.block_manager.num_hits > 0 and outs[1].num_cached_tokens == 16
