"""`/v1/completions` with `echo: true` through the official client: the prompt's text and
logprobs (checked against Hugging Face) before the completion's, `max_tokens: 0` for scoring."""

from __future__ import annotations

import functools

import pytest
import torch
from raylane.actors.engine import SamplingParams

from tests.e2e.conftest import MODEL
from tests.hf_reference import hf_model

PROMPT = "The quick brown fox jumps over the lazy dog."
OTHER = "Hello, world! How are you today?"
LONG = {"ignore_eos": True}  # random weights: make lengths predictable


@functools.lru_cache(maxsize=2)
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at position t - 1, for every prompt token t >= 1: [len - 1, V]."""
    logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def token_strings(model_dir: str, ids: list[int]) -> list[str]:
    tok = hf_tokenizer(model_dir)
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def assert_prompt_logprobs(lp, ids: list[int], model_dir: str, num_top: int) -> None:
    """The first len(ids) entries of a legacy logprobs object are the prompt's, as HF says."""
    n = len(ids)
    strings = token_strings(model_dir, ids)
    assert lp.tokens[:n] == strings
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_prompt_logprobs(model_dir, ids)  # [n - 1, V]
    want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    for k in range(1, n):
        top = lp.top_logprobs[k]
        assert strings[k] in top  # the prompt's own token is always there
        wanted = {*ref[k - 1].topk(num_top).indices.tolist(), ids[k]}
        # HF's top-N and the token itself, each with the logprob of a token spelled the same way
        # (two ids may decode alike, e.g. partial UTF-8 bytes)
        for t in wanted:
            key = token_strings(model_dir, [t])[0]
            same = [ref[k - 1, u].item() for u in wanted if token_strings(model_dir, [u])[0] == key]
            assert key in top
            assert any(abs(top[key] - v) <= 1e-4 for v in same), (k, key, top[key], same)
        assert len(top) <= num_top + 1


def assert_offsets_fit(choice) -> None:
    """text_offset k is the length of tokens 0..k-1 joined, and each token is found there in the
    returned text (up to the first token that is part of a UTF-8 character: its string is
    U+FFFD, which the text does not hold)."""
    lp = choice.logprobs
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    checked = 0
    for token, offset in zip(lp.tokens, lp.text_offset):
        if "\ufffd" in token:
            break
        assert choice.text[offset : offset + len(token)] == token
        checked += 1
    assert checked > 0


def test_max_tokens_zero_scores_the_prompt_like_hf(client, tiny_llama_dir):
    ids = hf_tokenizer(tiny_llama_dir).encode(PROMPT)
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0, temperature=0
    )
    choice = got.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert_prompt_logprobs(choice.logprobs, ids, tiny_llama_dir, 3)
    assert_offsets_fit(choice)
    assert got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == got.usage.total_tokens == len(ids)


def test_echo_then_completion_for_token_prompts(client, ref_engine, tiny_llama_dir):
    tok = hf_tokenizer(tiny_llama_dir)
    prompts = [tok.encode(PROMPT), tok.encode(OTHER)]
    got = client.completions.create(
        model=MODEL,
        prompt=prompts,
        echo=True,
        logprobs=2,
        max_tokens=4,
        temperature=0,
        extra_body=LONG,
    )
    assert [c.index for c in got.choices] == [0, 1]
    for ids, choice in zip(prompts, got.choices):
        ref = ref_engine.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, **LONG), use_tqdm=False
        )[0].outputs[0]
        assert choice.text == tok.decode(ids) + ref.text
        lp = choice.logprobs
        assert_prompt_logprobs(lp, ids, tiny_llama_dir, 2)
        assert lp.tokens[len(ids) :] == token_strings(tiny_llama_dir, ref.token_ids)
        assert lp.token_logprobs[len(ids) :] == pytest.approx(ref.logprobs, abs=1e-4)
        assert_offsets_fit(choice)
    assert got.usage.completion_tokens == 8
    assert got.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_echo_without_logprobs_batch_and_n(client):
    plain = client.completions.create(
        model=MODEL, prompt=[PROMPT, OTHER], max_tokens=3, n=2, seed=5, extra_body=LONG
    )
    echoed = client.completions.create(
        model=MODEL, prompt=[PROMPT, OTHER], max_tokens=3, n=2, seed=5, echo=True, extra_body=LONG
    )
    by_index = {c.index: c for c in plain.choices}
    assert sorted(by_index) == sorted(c.index for c in echoed.choices) == [0, 1, 2, 3]
    for c in echoed.choices:
        prompt = [PROMPT, OTHER][c.index // 2]
        assert c.text == prompt + by_index[c.index].text  # seeded: the same samples
        assert c.logprobs is None
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 12


def test_echo_n_repeats_the_prompt_logprobs(client, tiny_llama_dir):
    ids = hf_tokenizer(tiny_llama_dir).encode(OTHER)
    got = client.completions.create(
        model=MODEL, prompt=OTHER, echo=True, logprobs=1, max_tokens=2, n=3, seed=1, extra_body=LONG
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        assert c.text.startswith(OTHER)
        assert len(c.logprobs.tokens) == len(ids) + 2
        assert_prompt_logprobs(c.logprobs, ids, tiny_llama_dir, 1)


def test_max_tokens_zero_without_echo_is_refused(http):
    for body in (
        {"prompt": PROMPT, "max_tokens": 0},
        {"prompt": PROMPT, "max_tokens": 0, "echo": False, "logprobs": 1},
    ):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("max_tokens,n", [(0, 1), (5, 1), (3, 2)])
def test_stream_echo_equals_non_stream(client, max_tokens, n):
    args = {
        "model": MODEL,
        "prompt": [PROMPT, OTHER],
        "echo": True,
        "logprobs": 2,
        "max_tokens": max_tokens,
        "n": n,
        "temperature": 0,
        "extra_body": LONG,
    }
    whole = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    logprobs: dict[int, list] = {}
    offsets: dict[int, list] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        if c.index not in texts:  # a choice's first chunk carries its whole prompt
            prompt = [PROMPT, OTHER][c.index // n]
            assert c.text.startswith(prompt)
            assert "".join(c.logprobs.tokens).startswith(prompt)
        texts[c.index] = texts.get(c.index, "") + c.text
        tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
        logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
        finish[c.index] = c.finish_reason
    assert len(whole.choices) == len(texts) == 2 * n
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert logprobs[c.index][0] is None
        assert logprobs[c.index][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-5)
        # offsets agree up to the first partial UTF-8 character: a stream counts from the text
        # sent so far, a whole response from the token strings
        clean = next((k for k, t in enumerate(tokens[c.index]) if "\ufffd" in t), None)
        assert offsets[c.index][:clean] == c.logprobs.text_offset[:clean]
        assert finish[c.index] == c.finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 2 * n * max_tokens
