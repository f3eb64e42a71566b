"""Engine behaviour beyond greedy parity: seeds, stops, n, abort, chat and bad input."""

from __future__ import annotations

import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama_dir, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    vocab = engine.validator.vocab_size
    return [[(7 * i + 3 * j) % (vocab - 5) + 5 for j in range(10 + 7 * i)] for i in range(6)]


def run(engine, prompts, params):
    return engine.generate(prompts, params, use_tqdm=False)


def test_seeded_sampling_is_batch_independent(engine, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = run(engine, [prompts[2]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    batched = run(engine, prompts, [others, others, params, others, others, others])
    assert batched[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert run(engine, [prompts[2]], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(engine, prompts):
    g = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    k1 = run(
        engine, prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in g] == [o.outputs[0].token_ids for o in k1]


def test_stop_string_trims_text(engine, prompts):
    base = run(engine, [prompts[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[
        0
    ].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 2]
    assert stop.strip(), "the tiny model should produce visible text"
    out = run(
        engine,
        [prompts[1]],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.find(stop)]
    kept = run(
        engine,
        [prompts[1]],
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
    )
    assert kept[0].outputs[0].text == base.text[: base.text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(engine, prompts):
    base = (
        run(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    stop_id = base[3]
    first = base.index(stop_id)
    out = run(
        engine,
        [prompts[0]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    late = run(
        engine,
        [prompts[0]],
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop_token_ids=[stop_id],
            min_tokens=first + 2,
        ),
    )[0].outputs[0]
    assert len(late.token_ids) >= first + 2
    assert stop_id not in late.token_ids[: first + 1]  # masked until min_tokens


def test_n_samples_share_prompt_blocks(engine, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    out = run(engine, [prompts[4]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    queries, hits = engine.block_manager.num_queries, engine.block_manager.num_hits
    greedy = run(
        engine, [prompts[5]], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    # the second sample found the first one's full prompt blocks in the cache
    assert engine.block_manager.num_hits - hits >= (len(prompts[5]) - 1) // 16 * 16
    assert engine.block_manager.num_queries > queries


def test_abort_mid_generation_frees_blocks(engine, prompts):
    total = engine.block_manager.num_blocks
    engine.add_request("to-abort", prompts[3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("to-keep", prompts[2], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < total
    engine.abort_request("to-abort")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["to-keep"]
    assert engine.block_manager.num_free_blocks == total


def test_chat_renders_the_template(engine):
    messages = [{"role": "user", "content": "hello there"}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    via_chat = engine.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    direct = engine.generate(
        engine.tokenizer.encode(ids, add_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=False,
    )
    assert via_chat[0].prompt_token_ids == direct[0].prompt_token_ids
    assert via_chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_prompt_logprobs_match_a_full_forward(engine, prompts):
    import torch

    from tests.hf_reference import hf_model

    out = run(engine, [prompts[3]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[
        0
    ]
    with torch.inference_mode():
        logits = hf_model(engine.config.model)(torch.tensor([prompts[3]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    assert out.prompt_logprobs[0] is None
    for t in range(1, len(prompts[3])):
        tok = prompts[3][t]
        assert abs(out.prompt_logprobs[t][tok] - ref[t - 1, tok].item()) < 1e-4


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda e: e.add_request("x", [], SamplingParams()), "prompt"),
        (lambda e: e.add_request("x", [10**9], SamplingParams()), "prompt"),
        (lambda e: e.add_request("x", [5] * 100_000, SamplingParams()), "prompt"),
        (lambda e: e.add_request("x", [5, 6], SamplingParams(logprobs=10_000)), "logprobs"),
        (
            lambda e: e.add_request("x", [5, 6], SamplingParams(return_routed_experts=True)),
            "return_routed_experts",
        ),
        (lambda e: e.add_request("x", 3.5, SamplingParams()), "prompt"),
        (lambda e: SamplingParams(max_tokens=-1), "max_tokens"),
        (lambda e: SamplingParams(temperature=-0.5), "temperature"),
        (lambda e: SamplingParams(top_p=0), "top_p"),
        (lambda e: SamplingParams(n=0), "n"),
        (lambda e: SamplingParams(max_tokenz=3), "max_tokenz"),
        (lambda e: SamplingParams(stop=[""]), "stop"),
        (lambda e: EngineConfig(model="m", block_size=0), "block_size"),
        (lambda e: EngineConfig(model="m", dtype="float8"), "dtype"),
        (lambda e: EngineConfig(model="m", not_an_option=1), "not_an_option"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(engine, make, field):
    with pytest.raises(ValueError, match=field):
        make(engine)
    assert not engine.has_unfinished_requests()
