"""The batch-invariant mode at TP = 2 (Ray shards): each request's tokens, logprobs and top
logprobs are the same alone as in a mixed batch with staggered lengths, in bfloat16 (the
reference is the same engine, one request at a time, cold cache). Each rank pads its rows the
same way and the all-reduce adds the ranks' partial sums elementwise, an order independent of
the batch."""

from __future__ import annotations

import pytest
from raylane.actors.engine import SamplingParams

from tests.ray.tp_helpers import build, prompts_for


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_llama_dir):
    engine = build(tiny_llama_dir, tensor_parallel_size=2, dtype="bfloat16", batch_invariant=True)
    yield engine
    engine.shutdown()


def test_alone_equals_in_a_batch_at_tp2(engine):
    prompts = prompts_for(engine.validator.vocab_size, (3, 17, 8, 30, 5, 12))
    params = [
        SamplingParams(seed=7 + i, max_tokens=10 + i, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    batch = engine.generate(prompts, params, use_tqdm=False)
    for prompt, p, together in zip(prompts, params, batch):
        engine.flush_cache()
        (alone,) = engine.generate([prompt], p, use_tqdm=False)
        a, b = alone.outputs[0], together.outputs[0]
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (
            b.token_ids,
            b.logprobs,
            b.top_logprobs,
        )
