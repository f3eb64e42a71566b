"""SGLang-style /generate, /tokenize and /detokenize against the engine and the tokenizer."""

from __future__ import annotations

import itertools
import json

import pytest
from raylane.actors.engine import SamplingParams

PROMPT_IDS = [5, 17, 42, 99, 7, 150, 33]


def offline(ref_engine, prompt, **params):
    return ref_engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_generate_token_in_token_out_equals_engine(http, ref_engine):
    ref = offline(
        ref_engine, PROMPT_IDS, temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True
    )
    got = http.post(
        "/generate",
        json={
            "input_ids": PROMPT_IDS,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    want = ref.outputs[0]
    assert got["output_ids"] == want.token_ids and got["text"] == want.text
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(PROMPT_IDS) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == ref.weight_version and meta["routed_experts"] is None
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want.token_ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(
        want.logprobs, abs=1e-4
    )
    for top, ref_top in zip(meta["output_top_logprobs"], want.top_logprobs):
        assert {t: lp for lp, t, _ in top} == pytest.approx(ref_top, abs=1e-4)


def test_generate_text_batch_and_n(http, ref_engine, engine):
    texts = ["Hello, world!", "The capital of France"]
    got = http.post(
        "/generate",
        json={
            "text": texts,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True},
        },
    ).json()
    assert [g["index"] for g in got] == [0, 1, 2, 3]
    for i, text in enumerate(texts):
        ref = offline(ref_engine, text, temperature=0.0, max_tokens=4, ignore_eos=True)
        for sample in got[2 * i : 2 * i + 2]:  # greedy: both samples are the same
            assert sample["output_ids"] == ref.outputs[0].token_ids
            assert sample["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(text))


def test_generate_stop_reports_matched(http, ref_engine):
    ref = offline(ref_engine, PROMPT_IDS, temperature=0.0, max_tokens=10, ignore_eos=True)
    stop_id = ref.outputs[0].token_ids[3]
    got = http.post(
        "/generate",
        json={
            "input_ids": PROMPT_IDS,
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0,
                "stop_token_ids": [stop_id],
                "ignore_eos": True,
            },
        },
    ).json()
    first = ref.outputs[0].token_ids.index(stop_id)
    assert got["output_ids"] == ref.outputs[0].token_ids[: first + 1]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_generate_stream_is_cumulative_and_ends_with_done(http, ref_engine):
    ref = offline(ref_engine, PROMPT_IDS, temperature=0.0, max_tokens=6, ignore_eos=True)
    body = {
        "input_ids": PROMPT_IDS,
        "stream": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    with http.stream("POST", "/generate", json=body) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for prev, cur in itertools.pairwise(chunks):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert chunks[-1]["output_ids"] == ref.outputs[0].token_ids
    assert chunks[-1]["text"] == ref.outputs[0].text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_sampling_seed(http):
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 1.0,
            "sampling_seed": 5,
            "ignore_eos": True,
        },
    }
    first, second = (http.post("/generate", json=body).json() for _ in range(2))
    assert first["output_ids"] == second["output_ids"]


def test_tokenize_equals_tokenizer(http, engine):
    tok = engine.tokenizer
    text = "Hello, world! How are you?"
    got = http.post("/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == engine.config.max_model_len
    messages = [{"role": "user", "content": text}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(want, add_special_tokens=False)


def test_detokenize_round_trips(http, engine):
    text = "The quick brown fox jumps over the lazy dog."
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    got = http.post("/detokenize", json={"tokens": ids}).json()
    assert got["prompt"] == engine.tokenizer.decode(ids) and text in got["prompt"]
