"""The one table of sampling-field names against SamplingParams, the pydantic bodies, and a
round trip: a client body, parsed and turned back into SamplingParams, is what the caller gave."""

from __future__ import annotations

import dataclasses

import pytest
from raylane.actors.engine.sampling_names import (
    ALIASES,
    GUIDED,
    SPELLINGS,
    STRUCTURED_SGLANG,
    copied_fields,
)
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.client.wire import chat_body, generate_body
from raylane.session_server.sampling import openai_params, sglang_params
from raylane.session_server.schemas import (
    ChatCompletionRequest,
    GenerateRequest,
    OpenAISampling,
    SGLangSamplingParams,
)

# SGLang fields accepted and ignored (byte-level tokenizers have no spaces to add), and
# `stop_regex`, which SGLang's own client always sends: served empty, a 400 otherwise
_SGLANG_IGNORED = {"spaces_between_special_tokens", "stop_regex"}
# every copied field away from its default, so a dropped or misnamed one shows
_ODD = {
    "n": 1,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 11,
    "min_tokens": 2,
    "stop": ["x", "yz"],
    "stop_token_ids": [4, 9],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "max_tokens": 7,
}


def test_every_sampling_params_field_is_in_the_table_once():
    fields = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    assert sorted(s.field for s in SPELLINGS) == sorted(fields)


def test_the_bodies_carry_exactly_the_table_names():
    openai = {s.openai for s in SPELLINGS if s.openai} | set(GUIDED)
    assert openai <= set(OpenAISampling.model_fields) | set(ChatCompletionRequest.model_fields)
    inside = {s.sglang for s in SPELLINGS if s.sglang and not s.sglang_top}
    top = {s.sglang for s in SPELLINGS if s.sglang_top}
    assert top <= set(GenerateRequest.model_fields)
    named = inside | set(ALIASES["sglang"]) | set(STRUCTURED_SGLANG) | _SGLANG_IGNORED
    assert named == set(SGLangSamplingParams.model_fields)


def test_copied_fields_pass_names_only_where_an_api_carries_them():
    assert copied_fields("sglang")["include_stop_str_in_output"] == "no_stop_trim"
    assert copied_fields("sglang")["min_tokens"] == "min_new_tokens"
    assert "max_weight_lag" not in copied_fields("openai")
    assert "max_tokens" not in copied_fields("openai")  # checked against the context first


@pytest.mark.parametrize("rl", [False, True])
def test_a_generate_body_parses_back_to_the_callers_params(rl):
    extra = {"max_weight_lag": 2, "return_kept_mass": True} if rl else {}
    given = SamplingParams(**_ODD, **extra, logprobs=3, return_routed_experts=True)
    body = GenerateRequest.model_validate(generate_body([1, 2], given, "rid", None))
    sp = body.sampling_params
    back = sglang_params(sp, sp.max_new_tokens, body.top_logprobs_num, body.return_routed_experts)
    assert back == given


def test_a_chat_body_parses_back_to_the_callers_params():
    given = SamplingParams(**_ODD, logprobs=0)
    raw = chat_body([{"role": "user", "content": "hi"}], given, None)
    body = ChatCompletionRequest.model_validate(raw)
    assert openai_params(body, body.max_tokens, 0) == given
