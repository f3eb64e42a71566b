"""Async scheduling against the serial engine: the same tokens, text, finish reasons and routed
experts, logprobs within 1e-5, for every way a request can end or be served; and both modes
against Hugging Face greedy on a staggered-arrival run."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from raylane.actors.engine import LLMEngine

from tests.hf_reference import hf_greedy
from tests.unit.async_helpers import (
    Arrivals,
    all_at_once,
    assert_same,
    drive,
    engine_for,
    greedy,
    prompts_for,
    run_both,
    seeded,
)

LENGTHS = (9, 17, 24, 33, 40, 51, 63, 70)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> LLMEngine:
    """A serial engine on the tiny Llama, to find stop tokens and strings its outputs reach."""
    engine = engine_for(tiny_llama_dir, False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    return prompts_for(reference.validator.vocab_size, LENGTHS)


def frequent_tokens(engine: LLMEngine, prompts: list[list[int]], within: int = 6) -> list[int]:
    """Tokens that greedy decoding reaches early for the most prompts, most prompts first."""
    outs = engine.generate(prompts, greedy(16), use_tqdm=False)
    counts = Counter(t for o in outs for t in set(o.outputs[0].token_ids[:within]))
    return sorted(counts, key=lambda t: (-counts[t], t))


@pytest.fixture(scope="module")
def eos_llama(reference, prompts, tiny_llama_dir, tmp_path_factory) -> tuple[str, int]:
    """The tiny Llama (same weights) whose EOS is a token greedy decoding reaches early."""
    eos = frequent_tokens(reference, prompts)[0]
    path = tmp_path_factory.mktemp("eos_llama") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    return str(path), eos


def test_staggered_arrivals_match_serial_and_hf(tiny_llama_dir, prompts):
    # arrivals between steps, one while the engine is idle (step 40: all others are done)
    arrivals = {
        0: [("g0", prompts[0], greedy(10)), ("s0", prompts[1], seeded(1))],
        1: [("g1", prompts[5], greedy(12))],
        3: [("s1", prompts[3], seeded(2, 9)), ("g2", prompts[2], greedy(7))],
        6: [("g3", prompts[7], greedy(12)), ("s2", prompts[4], seeded(3, 15))],
        40: [("g4", prompts[6], greedy(8))],
    }
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)
    for rid, prompt, params in (a for adds in arrivals.values() for a in adds):
        if rid.startswith("g"):  # both modes equal an independent reference
            ids, lps = hf_greedy(tiny_llama_dir, prompt, params.max_tokens)
            for outs in (serial, ahead):
                assert outs[rid].outputs[0].token_ids == ids, rid
                np.testing.assert_allclose(outs[rid].outputs[0].logprobs, lps, atol=1e-4)


def test_eos_matches_serial(eos_llama, prompts):
    model_dir, eos = eos_llama
    params = [
        greedy(16, ignore_eos=False) if i % 2 else seeded(i, 16, ignore_eos=False)
        for i in range(len(prompts))
    ]
    serial, ahead = run_both(model_dir, lambda e: drive(e, all_at_once(prompts, params)))
    assert_same(ahead, serial)
    ended = [o.outputs[0] for o in serial.values()]
    assert any(
        c.finish_reason == "stop" and c.token_ids[-1] == eos and len(c.token_ids) < 16
        for c in ended
    ), "no request reached the EOS"
    assert any(c.finish_reason == "length" for c in ended)


def test_stop_token_ids_match_serial(tiny_llama_dir, reference, prompts):
    stop = frequent_tokens(reference, prompts)[:2]
    params = [
        greedy(16, stop_token_ids=stop) if i % 2 else seeded(i, 16, stop_token_ids=stop)
        for i in range(len(prompts))
    ]
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, all_at_once(prompts, params)))
    assert_same(ahead, serial)
    assert any(o.outputs[0].stop_reason in stop for o in serial.values())


def two_token_stop(tokenizer, ids: list[int], text: str) -> tuple[str, int] | None:
    """A stop string made of the end of one token's text and the start of the next one's,
    first found at that boundary in `text`; and how many tokens a run it stops keeps."""
    for j in range(2, len(ids) - 1):
        a, b = tokenizer.decode([ids[j]]), tokenizer.decode([ids[j + 1]])
        if not all(s.isascii() and s.isprintable() and s.strip() for s in (a, b)):
            continue
        head = tokenizer.decode(ids[: j + 1])
        stop = a[-2:] + b[:2]
        if text.startswith(head + b) and text.find(stop) == len(head) - len(a[-2:]):
            return stop, j + 2
    return None


def test_stop_string_spanning_two_tokens_matches_serial(tiny_llama_dir, reference, prompts):
    base = [o.outputs[0] for o in reference.generate(prompts, greedy(20), use_tqdm=False)]
    found = [
        (i, hit)
        for i, c in enumerate(base)
        if (hit := two_token_stop(reference.tokenizer, c.token_ids, c.text))
    ]
    assert found, "no greedy output has a stop string across two tokens"
    i, (stop, kept) = found[0]
    params = [
        greedy(20, stop=[stop]) if k % 2 else seeded(k, 20, stop=stop) for k in range(len(prompts))
    ]
    params[i] = greedy(20, stop=[stop])
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, all_at_once(prompts, params)))
    assert_same(ahead, serial)
    got = serial[f"r{i}"].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.token_ids == base[i].token_ids[:kept]
    assert got.text == base[i].text[: base[i].text.find(stop)]


def test_max_tokens_match_serial(tiny_llama_dir, prompts):
    limits = (1, 2, 3, 5, 8, 1, 13, 2)
    params = [greedy(m) if i % 2 else seeded(i, m) for i, m in enumerate(limits)]
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, all_at_once(prompts, params)))
    assert_same(ahead, serial)
    for i, m in enumerate(limits):
        out = ahead[f"r{i}"].outputs[0]
        assert (len(out.token_ids), out.finish_reason) == (m, "length")


def test_min_tokens_hold_off_eos_and_stop_tokens(eos_llama, reference, prompts):
    model_dir, eos = eos_llama
    stop = [t for t in frequent_tokens(reference, prompts) if t != eos][:1]
    kinds = {
        "free": greedy(16, ignore_eos=False, stop_token_ids=stop),
        "held": greedy(16, ignore_eos=False, stop_token_ids=stop, min_tokens=6),
        "seed": seeded(5, 16, ignore_eos=False, stop_token_ids=stop, min_tokens=5),
    }
    arrivals = {
        0: [
            (f"{kind}{i}", p, params)
            for kind, params in kinds.items()
            for i, p in enumerate(prompts)
        ]
    }
    serial, ahead = run_both(model_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)
    assert any(
        len(out.outputs[0].token_ids) < 6 for rid, out in serial.items() if rid.startswith("free")
    ), "no request would end before min_tokens"
    for rid, out in serial.items():
        min_tokens = kinds[rid[:4]].min_tokens
        ids = out.outputs[0].token_ids
        assert len(ids) >= min_tokens and not {eos, *stop} & set(ids[:min_tokens]), rid


def test_seeded_sampling_matches_serial(tiny_llama_dir, prompts):
    variants = [
        {},
        {"top_p": 0.9},
        {"top_k": 20},
        {"min_p": 0.05},
        {"temperature": 1.3},
        {"repetition_penalty": 1.2},
        {"top_p": 0.8, "top_k": 50},
        {},
    ]
    arrivals = {
        2 * i: [(f"s{i}", p, seeded(100 + i, 14, **kw))]
        for i, (p, kw) in enumerate(zip(prompts, variants))
    }
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)


def test_n_samples_match_serial(tiny_llama_dir, prompts):
    arrivals = {
        0: [("n3", prompts[3], seeded(9, 10, n=3)), ("g2", prompts[1], greedy(8, n=2))],
        2: [("n2", prompts[6], seeded(4, 12, n=2))],
    }
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)
    assert len({tuple(c.token_ids) for c in ahead["n3"].outputs}) > 1


def shared_prefix_arrivals(vocab: int, params_for) -> Arrivals:
    """Six prompts on one 40-token prefix (two full blocks): two at once, the rest after the
    first ones' prefill, then the first two again once every request has ended."""
    shared = prompts_for(vocab, (40,), seed=7)[0]
    tails = prompts_for(vocab, (3, 9, 14, 5, 21, 11), seed=8)
    ps = [shared + t for t in tails]
    return {
        0: [(f"a{i}", ps[i], params_for(i)) for i in range(2)],
        3: [(f"a{i}", ps[i], params_for(i)) for i in range(2, 6)],
        60: [(f"b{i}", ps[i], params_for(i)) for i in range(2)],
    }


def test_prefix_cache_hits_match_serial(tiny_llama_dir, reference):
    vocab = reference.validator.vocab_size
    arrivals = shared_prefix_arrivals(vocab, lambda i: greedy(10) if i % 2 else seeded(i, 10))
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)
    cached = {rid: o.num_cached_tokens for rid, o in serial.items()}
    assert {rid: o.num_cached_tokens for rid, o in ahead.items()} == cached
    assert cached["b0"] > 0 and cached["a3"] > 0, cached


@pytest.mark.parametrize("model", ["tiny_moe_dir", "tiny_deepseek_dir"])
def test_routed_experts_match_serial(model, reference, request):
    model_dir = request.getfixturevalue(model)

    def params_for(i):
        return (
            greedy(8, return_routed_experts=True)
            if i % 2
            else seeded(i, 8, return_routed_experts=True)
        )

    arrivals = shared_prefix_arrivals(reference.validator.vocab_size, params_for)
    serial, ahead = run_both(
        model_dir, lambda e: drive(e, arrivals), enable_return_routed_experts=True
    )
    assert_same(ahead, serial)  # the routed experts exactly
    assert any(o.num_cached_tokens > 0 for o in ahead.values())
    for out in ahead.values():
        c = out.outputs[0]
        assert c.routed_experts.shape[0] == len(out.prompt_token_ids) + len(c.token_ids) - 1
