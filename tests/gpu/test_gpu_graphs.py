"""CUDA graphs against eager on the GPU: identical tokens and logprobs, padded batches included.

Batch sizes 3 and 17 are not captured sizes (1, 2, 4, 8, 16, 24, 32), so they replay padded.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

from tests.gpu.device import needs_cuda

pytestmark = needs_cuda

BATCHES = (1, 3, 8, 17)
MAX_NEW = 24


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_moe_dir", "smollm2_dir"])
def engines(request) -> dict[bool, LLMEngine]:
    """enforce_eager -> engine, float32 on CUDA, no prefix cache (every prefill computed)."""
    model_dir = request.getfixturevalue(request.param)
    made = {
        eager: LLMEngine(
            EngineConfig(
                model=model_dir,
                device="cuda",
                dtype="float32",
                max_num_seqs=32,
                max_model_len=512,
                enable_prefix_caching=False,
                enforce_eager=eager,
            )
        )
        for eager in (False, True)
    }
    yield made
    for engine in made.values():
        engine.shutdown()


def prompts_for(vocab: int, count: int, seed: int) -> list[list[int]]:
    """Prompts of different lengths, so the decodes of one batch have different contexts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 70))] for _ in range(count)]


def run_both(engines: dict[bool, LLMEngine], prompts, params) -> tuple[list, list]:
    replays = engines[False].stats.graph_replays
    graphs = engines[False].generate(prompts, params, use_tqdm=False)
    eager = engines[True].generate(prompts, params, use_tqdm=False)
    assert engines[False].stats.graph_replays > replays, "the graphs engine replayed nothing"
    assert engines[True].stats.graph_replays == 0
    return [o.outputs[0] for o in graphs], [o.outputs[0] for o in eager]


@pytest.mark.parametrize("batch", BATCHES)
def test_graphs_match_eager_greedy(engines, batch):
    prompts = prompts_for(engines[True].validator.vocab_size, batch, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    graphs, eager = run_both(engines, prompts, params)
    for g, e in zip(graphs, eager):
        assert g.token_ids == e.token_ids
        assert np.allclose(g.logprobs, e.logprobs, atol=1e-3), (g.logprobs, e.logprobs)


@pytest.mark.parametrize("batch", BATCHES)
def test_graphs_match_eager_seeded_sampling(engines, batch):
    prompts = prompts_for(engines[True].validator.vocab_size, batch, seed=100 + batch)
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=1000 + i,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=1,
        )
        for i in range(batch)
    ]
    graphs, eager = run_both(engines, prompts, params)
    for g, e in zip(graphs, eager):
        assert g.token_ids == e.token_ids
        assert np.allclose(g.logprobs, e.logprobs, atol=1e-3), (g.logprobs, e.logprobs)
