"""Engine `SamplingParams` as the HTTP routes spell them: SGLang's `/generate` body and the
OpenAI chat body of a session turn.

The client checks every field by building `SamplingParams` first (an unknown or bad field is a
`ValueError` before anything is sent), then renames: both transports take the same keywords.
"""

from __future__ import annotations

from raylane.actors.engine.sampling_names import BY_FIELD, copied_fields
from raylane.actors.engine.sampling_params import SamplingParams

# SamplingParams field -> its /generate name inside `sampling_params`, and in a chat body
_GENERATE = {**copied_fields("sglang"), "max_tokens": BY_FIELD["max_tokens"].sglang}
_CHAT = {**copied_fields("openai"), "max_tokens": BY_FIELD["max_tokens"].openai}
# RL fields sent only when set, so the body stays valid for servers that predate them
_OPTIONAL = {"max_weight_lag": None, "return_kept_mass": False}
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
        key: getattr(params, name)
        for name, key in _GENERATE.items()
        if name not in _OPTIONAL or getattr(params, name) != _OPTIONAL[name]
    }
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling,
        "rid": request_id,
        "return_logprob": params.logprobs is not None,
        BY_FIELD["logprobs"].sglang: params.logprobs or 0,
        BY_FIELD["return_routed_experts"].sglang: params.return_routed_experts,
        BY_FIELD["return_indexer_topk"].sglang: params.return_indexer_topk,
    }
    if routing_key is not None:
        body["routing_key"] = routing_key
    return body


def chat_body(messages: list[dict], params: SamplingParams, tools: list[dict] | None) -> dict:
    """The OpenAI chat body of a session turn (one sample; token ids and logprobs back)."""
    if params.n != 1:
        raise ValueError("n must be 1 in a session: a session records one trajectory")
    body = {key: getattr(params, name) for name, key in _CHAT.items()}
    body.update(messages=messages, logprobs=True, return_token_ids=True)
    if tools is not None:
        body["tools"] = tools
    return body
