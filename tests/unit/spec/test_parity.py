"""Speculative decoding changes no token: greedy and seeded outputs, logprobs, top logprobs and
kept mass against the same engine without speculation (the reference), for n-gram and suffix
drafts; stops that end inside an accepted run; the counters against a count taken from the
step plans and results on the wire."""

from __future__ import annotations

import pytest
from raylane.actors.engine import SamplingParams

from tests.unit.spec.helpers import Tap, spec_engine

K = 4
# not adaptive: whether a draft pays depends on measured step times, and these tests count
# drafts (the adaptive path has tests of its own, on given timings)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": K, "adaptive": False}
LENGTHS = (9, 17, 30, 45)
ATOL = 1e-4


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    base = {"temperature": 0.0, "logprobs": 3, "return_kept_mass": True, "ignore_eos": True}
    return SamplingParams(**{**base, "max_tokens": max_tokens, **kw})


def assert_same(ref, out) -> None:
    """Same tokens, text and finish; logprobs, top logprobs and kept mass within ATOL."""
    for r, o in zip(ref, out):
        for a, b in zip(r.outputs, o.outputs):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            assert b.weight_versions == a.weight_versions
            pairs = list(zip(a.logprobs, b.logprobs)) + list(
                zip(a.kept_mass_logprobs or [], b.kept_mass_logprobs or [])
            )
            assert len(b.logprobs) == len(b.token_ids)
            assert all(abs(x - y) <= ATOL for x, y in pairs)
            for ta, tb in zip(a.top_logprobs, b.top_logprobs):
                assert ta.keys() == tb.keys()
                assert all(abs(ta[t] - tb[t]) <= ATOL for t in ta)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_output_and_counters(loopy_dir, reference, prompts, spec):
    params = greedy()
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(loopy_dir, spec)
    tap = Tap(engine, K)
    out = engine.generate(prompts, params, use_tqdm=False)
    assert_same(ref, out)
    stats = engine.stats
    # drafts were verified, and some (not all) were accepted: both paths ran
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts == tap.num_drafts
    assert stats.spec_decode_num_draft_tokens == tap.num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == tap.num_accepted
    assert stats.spec_decode_num_accepted_tokens_per_pos == tap.per_pos
    # every step yields one token per row plus the accepted ones: fewer steps than tokens
    generated = sum(len(o.outputs[0].token_ids) for o in out)
    assert stats.generation_tokens == generated
    engine.shutdown()


def twin_run(engine, prompt, params, lead_steps: int = 6):
    """Run `prompt` as "probe" behind a greedy twin ("lead", same prompt) that started
    `lead_steps` steps earlier: suffix drafts copy the lead's output, so the probe decodes in
    long accepted runs. Returns the probe's output and its runs (output spans one step
    produced with more than one token)."""
    from raylane.actors.engine.output_accumulator import OutputAccumulator

    engine.admit("lead", prompt, greedy(max_tokens=60))
    for _ in range(lead_steps):
        engine.step_deltas()
    engine.admit("probe", prompt, params)
    acc, runs, done = OutputAccumulator(), [], 0
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            if delta.request_id != "probe":
                continue
            new = len(delta.outputs[0].token_ids) if delta.outputs else 0
            if new > 1:
                runs.append((done, done + new))
            done += new
            acc.add(delta)
    return acc.output(), runs


def fresh_in_runs(tokens: list[int], runs) -> list[int]:
    """Output positions inside a run (not its last token) whose token appears there first."""
    return [p for s, e in runs for p in range(s, e - 1) if tokens[p] not in tokens[:p]]


def test_stops_inside_an_accepted_run(loopy_dir, reference, prompts):
    """A stop token, a stop string and max_tokens that land inside a run of accepted drafts:
    the output ends where the reference's does, and nothing after the stop comes back."""
    engine = spec_engine(loopy_dir, SUFFIX)
    tokenizer = engine.tokenizer
    cases = 0
    for prompt in prompts[:2]:
        out, runs = twin_run(engine, prompt, greedy())
        tokens = out.outputs[0].token_ids
        for p in fresh_in_runs(tokens, runs)[1:3]:
            text = tokenizer.decode(tokens[: p + 1])
            variants = [greedy(max_tokens=p + 1), greedy(stop_token_ids=[tokens[p]])]
            if text[-2:].strip() and text[-2:] not in text[:-1]:
                variants.append(greedy(stop=[text[-2:]], include_stop_str_in_output=True))
            for params in variants:
                ref = reference.generate([prompt], params, use_tqdm=False)
                got, got_runs = twin_run(engine, prompt, params)
                assert_same(ref, [got])
                cases += any(s < p < e for s, e in got_runs)
    assert cases >= 4
    engine.shutdown()


def test_eos_inside_an_accepted_run(loopy_dir, prompts, tmp_path):
    """The model's EOS is a token that greedy decoding reaches inside an accepted run."""
    import json
    import shutil

    engine = spec_engine(loopy_dir, SUFFIX)
    out, runs = twin_run(engine, prompts[0], greedy())
    engine.shutdown()
    tokens = out.outputs[0].token_ids
    p = fresh_in_runs(tokens, runs)[1]
    model = tmp_path / "eos_model"
    shutil.copytree(loopy_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = tokens[p]
    (model / "config.json").write_text(json.dumps(config))
    params = greedy(ignore_eos=False)
    ref_engine, engine = spec_engine(str(model), None), spec_engine(str(model), SUFFIX)
    ref = ref_engine.generate([prompts[0]], params, use_tqdm=False)
    got, got_runs = twin_run(engine, prompts[0], params)
    assert_same(ref, [got])
    assert len(got.outputs[0].token_ids) == p + 1
    assert got.outputs[0].finish_reason == "stop"
    assert any(s < p < e for s, e in got_runs)
    ref_engine.shutdown()
    engine.shutdown()


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.7, seed=seed, max_tokens=40, logprobs=2, ignore_eos=True, **kw
    )


def test_seeded_sampling_is_the_reference_alone_and_in_a_batch(loopy_dir, reference, prompts):
    """Seeded requests draw each position's token with that position's words: the output is
    the non-speculative one, whatever runs beside it."""
    params = [seeded(s) for s in range(len(prompts))]
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(loopy_dir, NGRAM)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    alone = engine.generate(prompts[1:2], params[1:2], use_tqdm=False)
    assert_same(ref[1:2], alone)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()
