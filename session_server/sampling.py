"""Request fields -> engine `SamplingParams`, and the context-length check both APIs share."""

from __future__ import annotations

from actors.engine.sampling_params import SamplingParams
from session_server.backend import ModelInfo
from session_server.errors import bad_request
from session_server.schemas import ChatCompletionRequest, OpenAISampling, SGLangSamplingParams

# engine field -> SGLang field, so a /generate error names what the client sent
SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
                "logprobs": "top_logprobs_num", "prompt": "input_ids",
                "include_stop_str_in_output": "no_stop_trim"}
# SamplingParams fields both APIs carry (under SGLANG_NAMES' names in /generate)
_SHARED = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "min_tokens", "stop", "stop_token_ids",
           "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# what an OpenAI field sent as null (or left out) means
_OPENAI_NULLS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                 "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def resolve_max_tokens(requested: int | None, prompts: list[list[int]], info: ModelInfo,
                       field: str, prompt_field: str) -> int | None:
    """The tokens to generate: what was asked if it fits the context, else a 400; the rest of
    the context when nothing was asked."""
    longest = max(len(p) for p in prompts)
    room = info.max_model_len - longest
    if room <= 0:
        raise bad_request(f"{prompt_field}: {longest} tokens leave no room to generate within "
                          f"the model's context of {info.max_model_len} tokens", prompt_field)
    if requested is None:
        return room
    if requested > room:
        raise bad_request(f"{field}: {requested} tokens requested, but the prompt uses {longest} "
                          f"of the model's {info.max_model_len}-token context; at most {room} "
                          f"can be generated", field)
    return requested


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """What a chat request asks to generate, and the field it was asked in."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def openai_params(body: OpenAISampling, max_tokens: int | None,
                  logprobs: int | None) -> SamplingParams:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    fields = {name: _or(getattr(body, name), _OPENAI_NULLS.get(name)) for name in _SHARED}
    return SamplingParams(**fields, seed=body.seed, max_tokens=max_tokens, logprobs=logprobs,
                          return_routed_experts=body.return_routed_experts)


def sglang_params(sp: SGLangSamplingParams, max_tokens: int | None, logprobs: int | None,
                  return_routed_experts: bool) -> SamplingParams:
    fields = {name: getattr(sp, SGLANG_NAMES.get(name, name)) for name in _SHARED}
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    return SamplingParams(**fields, seed=seed, max_tokens=max_tokens, logprobs=logprobs,
                          return_routed_experts=return_routed_experts,
                          max_weight_lag=sp.max_weight_lag, return_kept_mass=sp.return_kept_mass)


def _or(value, default):
    return default if value is None else value
