"""RL with drafts: a weight update between speculative steps. Each token carries the version
of the weights that produced it, and the output equals a run without speculation updated
after the same number of tokens (n-gram and suffix drafts hold no weights: nothing of theirs
is versioned; the KV of tokens before the update is kept in both runs)."""

from __future__ import annotations

import numpy as np
from raylane.actors.engine import SamplingParams

from tests.hf_reference import perturbed_model
from tests.unit.spec.helpers import spec_engine
from tests.unit.spec.test_parity import NGRAM


def run_with_update(engine, prompt, weights, update_at) -> tuple[object, int]:
    """Step one greedy request; once it has >= `update_at` tokens, update the weights
    (the next version). Returns its final output and the token count at the update."""
    from raylane.actors.engine.output_accumulator import OutputAccumulator

    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    engine.add_request("r", prompt, params)
    acc, count, updated_at = OutputAccumulator(), 0, None
    while engine.has_unfinished_requests():
        if updated_at is None and count >= update_at:
            engine.update_weights(weights)
            updated_at = count
        for delta in engine.step():
            count += len(delta.outputs[0].token_ids) if delta.outputs else 0
            acc.add(delta)
    return acc.output(), updated_at


def test_weight_update_between_speculative_steps(loopy_dir, reference, prompts, tmp_path):
    _, weights = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    _, v0 = perturbed_model(loopy_dir, str(tmp_path / "v0"), 0, 0.0)
    engine = spec_engine(loopy_dir, NGRAM)
    for prompt in prompts:
        got, at = run_with_update(engine, prompt, weights, 24)
        want, ref_at = run_with_update(reference, prompt, weights, at)
        assert at == ref_at
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        v = reference.weight_version
        assert a.weight_versions == b.weight_versions == [v - 1] * at + [v] * (40 - at)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
        for e in (engine, reference):  # back on v0 (version 2) for the next prompt
            e.update_weights(v0, version=e.weight_version + 1)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()
