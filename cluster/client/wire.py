"""Engine `SamplingParams` as the HTTP routes spell them: SGLang's `/generate` body and the
OpenAI chat body of a session turn.

The client checks every field by building `SamplingParams` first (an unknown or bad field is a
`ValueError` before anything is sent), then renames: both transports take the same keywords.
"""

from __future__ import annotations

from raylane.actors.engine.sampling_params import SamplingParams

# SamplingParams field -> /generate `sampling_params` field, where the names differ
_SGLANG = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "include_stop_str_in_output": "no_stop_trim",
}
# fields /generate carries inside `sampling_params` (under _SGLANG's names)
_GENERATE_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "max_weight_lag",
    "return_kept_mass",
)
# RL fields sent only when set, so the body stays valid for servers that predate them
_OPTIONAL = {"max_weight_lag": None, "return_kept_mass": False}
# fields the OpenAI chat body of a session turn carries under their own names
_CHAT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
# defaults the client sends unless told otherwise: trainers need each token's logprob
CLIENT_DEFAULTS = {"logprobs": 0}


def sampling_params(fields: dict) -> SamplingParams:
    """The engine's params for the keywords a caller gave (ValueError names a bad one)."""
    try:
        return SamplingParams(**{**CLIENT_DEFAULTS, **fields})
    except TypeError as e:  # an unknown keyword
        raise ValueError(f"sampling: {e}") from None


def generate_body(
    prompt_ids: list[int], params: SamplingParams, request_id: str, routing_key: str | None
) -> dict:
    """The `/generate` body for one prompt."""
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not available over HTTP; use the in-cluster client")
    sampling = {
        _SGLANG.get(name, name): getattr(params, name)
        for name in _GENERATE_FIELDS
        if name not in _OPTIONAL or getattr(params, name) != _OPTIONAL[name]
    }
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling,
        "rid": request_id,
        "return_logprob": params.logprobs is not None,
        "top_logprobs_num": params.logprobs or 0,
        "return_routed_experts": params.return_routed_experts,
    }
    if routing_key is not None:
        body["routing_key"] = routing_key
    return body


def chat_body(messages: list[dict], params: SamplingParams, tools: list[dict] | None) -> dict:
    """The OpenAI chat body of a session turn (one sample; token ids and logprobs back)."""
    if params.n != 1:
        raise ValueError("n must be 1 in a session: a session records one trajectory")
    body = {name: getattr(params, name) for name in _CHAT_FIELDS}
    body.update(messages=messages, logprobs=True, return_token_ids=True)
    if tools is not None:
        body["tools"] = tools
    return body
