"""RL with drafts: a weight update between speculative steps, and pause(keep) / pause(retract)
while a verify step is in flight. Each token carries the version
of the weights that produced it, and the output equals a run without speculation updated
after the same number of tokens (n-gram and suffix drafts hold no weights: nothing of theirs
is versioned; the KV of tokens before the update is kept in both runs)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams
from raylane.actors.engine.async_engine import AsyncLLMEngine
from raylane.actors.models.weights import specs_of

from tests.hf_reference import perturbed_model
from tests.unit.spec.helpers import make_loopy_llama, spec_engine
from tests.unit.spec.test_parity import NGRAM


def run_with_update(engine, prompt, weights, update_at, retract=False) -> tuple[object, int]:
    """Step one greedy request; once it has >= `update_at` tokens, update the weights
    (the next version; `retract`: free its KV first, so it re-prefills under them). Returns
    its final output and the token count at the update."""
    from raylane.actors.engine.output_accumulator import OutputAccumulator

    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    engine.admit("r", prompt, params)
    acc, count, updated_at = OutputAccumulator(), 0, None
    while engine.has_unfinished_requests():
        if updated_at is None and count >= update_at:
            if retract:
                engine.retract_all()
            engine.update_weights(weights)
            updated_at = count
        for delta in engine.step_deltas():
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


class VerifyGate:
    """Holds the first verify step planned once `armed`: its future completes only after the
    test says it is pausing, so the pause is called while that step is in flight (the step
    loop awaits it) and its drain folds the step in."""

    def __init__(self, engine):
        self.armed, self.seen, self.pausing = False, threading.Event(), threading.Event()
        self.drafts: tuple = ()
        submit = engine.executor.submit

        def gated(plan):
            future = submit(plan)
            if not (self.armed and plan.draft_token_ids):
                return future
            self.armed, self.drafts = False, plan.draft_token_ids
            held: Future = Future()
            threading.Thread(target=self._release, args=(future, held), daemon=True).start()
            self.seen.set()
            return held

        engine.executor.submit = gated

    def _release(self, future: Future, held: Future) -> None:
        self.pausing.wait()
        held.set_result(future.result())


@pytest.mark.parametrize(
    ("mode", "method"), [("keep", "ngram"), ("retract", "ngram"), ("retract", "draft_model")]
)
def test_pause_with_drafts_in_flight(loopy_dir, reference, prompts, tmp_path, mode, method):
    """pause(keep) / pause(retract) lands while a verify step runs, then a weight update and
    resume: each request's tokens, versions and logprobs are those of the engine without
    speculation paused (and retracted) after as many tokens."""
    _, v1 = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    _, v0 = perturbed_model(loopy_dir, str(tmp_path / "v0"), 0, 0.0)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, ignore_eos=True)
    spec = NGRAM
    if method == "draft_model":
        draft = make_loopy_llama(tmp_path / "draft", attention_scale=0.03)
        spec = {"method": method, "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    engine = spec_engine(loopy_dir, spec)
    gate = VerifyGate(engine)

    async def main():
        aeng = AsyncLLMEngine(engine)
        tasks = [
            asyncio.create_task(_last(aeng, p, params, f"r{i}")) for i, p in enumerate(prompts)
        ]
        while not any(r.seqs[0].num_output_tokens >= 4 for r in engine.requests.values()):
            await asyncio.sleep(0.001)
        gate.armed = True  # hold the next verify step
        while not gate.seen.is_set():
            assert not all(t.done() for t in tasks), "no verify step after the first tokens"
            await asyncio.sleep(0.001)
        gate.pausing.set()
        await aeng.pause(mode)  # drains the held verify step
        at = [engine.requests[f"r{i}"].seqs[0].num_output_tokens for i in range(len(prompts))]
        aeng.begin_weight_update(specs_of(v1))
        aeng.load_weight_bucket(dict(v1))
        aeng.finish_weight_update(1)
        await aeng.resume()
        return at, await asyncio.gather(*tasks)

    at, outs = asyncio.run(main())
    assert gate.drafts  # a step with drafts was in flight at the pause
    for prompt, done, got in zip(prompts, at, outs):
        v = reference.weight_version  # the module's reference was updated before
        want, ref_at = run_with_update(reference, prompt, v1, done, retract=mode == "retract")
        assert ref_at == done
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.weight_versions == [0] * done + [1] * (40 - done)
        assert b.weight_versions == [v] * done + [v + 1] * (40 - done)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
        reference.update_weights(v0, version=reference.weight_version + 1)
    engine.shutdown()


async def _last(aeng, prompt, params, rid):
    out = None
    async for out in aeng.generate(prompt, params, rid):
        pass
    return out
