"""The OpenAI API through the official client, checked against the engine run directly."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from raylane.actors.engine import SamplingParams

from tests.e2e.conftest import MODEL

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT = "The quick brown fox"
LONG = {"ignore_eos": True}  # random weights: make lengths predictable


def offline(ref_engine, prompt, **params):
    return ref_engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def offline_chat(ref_engine, messages, **params):
    return ref_engine.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == engine.config.max_model_len
    assert models[0].batch_invariant is False  # raylane's key, beside OpenAI's
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_the_model_card_says_when_the_mode_is_batch_invariant(client, probe, monkeypatch):
    monkeypatch.setattr(probe, "info", dataclasses.replace(probe.info, batch_invariant=True))
    (card,) = client.models.list().data
    assert card.id == MODEL and card.batch_invariant is True
    assert client.models.retrieve(MODEL).batch_invariant is True


def test_greedy_completion_equals_offline_engine(client, ref_engine):
    ref = offline(ref_engine, PROMPT, temperature=0.0, max_tokens=12)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.id.startswith("cmpl-") and got.object == "text_completion"
    choice = got.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_greedy_chat_equals_offline_engine(client, ref_engine):
    ref = offline_chat(ref_engine, MESSAGES, temperature=0.0, max_tokens=12)
    got = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert got.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert got.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids


def test_chat_stream_equals_non_stream(client, ref_engine):
    ref = offline_chat(ref_engine, MESSAGES, temperature=0.0, max_tokens=10, **LONG)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 10
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_offline(client, ref_engine):
    ref = offline(ref_engine, PROMPT, temperature=0.0, max_tokens=10, **LONG)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, extra_body=LONG
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_match_engine(client, ref_engine):
    ref = offline_chat(ref_engine, MESSAGES, temperature=0.0, max_tokens=6, logprobs=3, **LONG)
    got = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={**LONG, "return_token_ids": True},
    )
    choice, want = got.choices[0], ref.outputs[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    content = choice.logprobs.content
    assert [e.logprob for e in content] == pytest.approx(want.logprobs, abs=1e-4)
    for entry, top in zip(content, want.top_logprobs):
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            sorted(top.values(), reverse=True), abs=1e-4
        )
        assert bytes(entry.bytes).decode("utf-8") == entry.token


def test_completion_logprobs_and_token_prompts(client, ref_engine, engine):
    ids = engine.tokenizer.encode(PROMPT)
    ref = offline(ref_engine, ids, temperature=0.0, max_tokens=5, logprobs=2, **LONG)
    got = client.completions.create(
        model=MODEL,
        prompt=[ids, ids],
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={**LONG, "return_token_ids": True},
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice in got.choices:
        assert choice.model_extra["prompt_token_ids"] == ids
        assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids
        lp = choice.logprobs
        assert lp.token_logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)
        assert "".join(lp.tokens) == choice.text == ref.outputs[0].text
        assert all(len(t) == 2 for t in lp.top_logprobs)
    assert got.usage.prompt_tokens == 2 * len(ids)


def test_max_completion_tokens_and_cached_prompt(client, engine):
    def ask():
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES * 3, max_completion_tokens=3, extra_body=LONG
        )

    first, second = ask(), ask()
    assert first.usage.completion_tokens == second.usage.completion_tokens == 3
    block = engine.config.block_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // block * block > 0


def test_n_choices(client):
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=3, temperature=1.0, seed=11, extra_body=LONG
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert got.usage.completion_tokens == 15


def test_n_choices_stream(client):
    stream = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, "Hello"],
        max_tokens=4,
        n=2,
        stream=True,
        seed=2,
        extra_body=LONG,
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}


def test_stop_string_honoured(client, ref_engine):
    full = offline(ref_engine, PROMPT, temperature=0.0, max_tokens=24, **LONG).outputs[0].text
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].isprintable())
    want = full[: full.index(stop)]
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body=LONG
    )
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body=LONG,
    )
    assert "".join(c.choices[0].text for c in stream) == want  # nothing of the stop leaks


def test_seed_reproduces(client):
    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body=LONG,
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampling_extensions_reach_the_engine(client, ref_engine):
    params = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 4}
    ref = offline(
        ref_engine,
        PROMPT,
        temperature=0.8,
        seed=3,
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        **params,
    )
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        extra_body=params,
    )
    assert got.choices[0].text == ref.outputs[0].text


def test_tools_reach_the_chat_template(http, engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"messages": MESSAGES, "tools": tools, "max_tokens": 1, "return_token_ids": True}
    got = http.post("/v1/chat/completions", json=body).json()
    want = engine.tokenizer.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "get_weather" in want
    assert got["prompt_token_ids"] == engine.tokenizer.encode(want, add_special_tokens=False)


def test_routing_key_from_header_then_body(http, probe):
    body = {"prompt": PROMPT, "max_tokens": 1, "user": "user-1"}
    http.post("/v1/completions", json=body)
    http.post("/v1/completions", json=body, headers={"x-session-id": "sess-9"})
    http.post(
        "/v1/completions", json=body, headers={"x-routing-key": "key-3", "x-session-id": "sess-9"}
    )
    http.post(
        "/generate",
        json={"text": PROMPT, "routing_key": "rk", "sampling_params": {"max_new_tokens": 1}},
    )
    assert [key for _, key in probe.calls] == ["user-1", "sess-9", "key-3", "rk"]
    assert probe.calls[0][0].startswith("cmpl-")
