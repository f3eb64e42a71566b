"""Request fields -> engine `SamplingParams`, and the context-length check both APIs share."""

from __future__ import annotations

import dataclasses

from raylane.actors.engine.sampling_names import (
    ALIASES,
    GUIDED,
    STRUCTURED_SGLANG,
    copied_fields,
    sglang_error_names,
)
from raylane.actors.engine.sampling_params import (
    STRUCTURED_KINDS,
    SamplingParams,
    StructuredOutputsParams,
)
from raylane.session_server.backend import ModelInfo
from raylane.session_server.errors import bad_request
from raylane.session_server.schemas import (
    ChatCompletionRequest,
    OpenAISampling,
    SGLangSamplingParams,
)

# engine field -> SGLang field, so a /generate error names what the client sent
SGLANG_NAMES = sglang_error_names()
_OPENAI = copied_fields("openai")
_SGLANG = copied_fields("sglang")
# what an OpenAI field sent as null (or left out) means
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


def resolve_max_tokens(
    requested: int | None, prompts: list[list[int]], info: ModelInfo, field: str, prompt_field: str
) -> int | None:
    """The tokens to generate: what was asked if it fits the context, else a 400; the rest of
    the context when nothing was asked."""
    longest = max(len(p) for p in prompts)
    room = info.max_model_len - longest
    if room <= 0:
        raise bad_request(
            f"{prompt_field}: {longest} tokens leave no room to generate within "
            f"the model's context of {info.max_model_len} tokens",
            prompt_field,
        )
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"{field}: {requested} tokens requested, but the prompt uses {longest} "
            f"of the model's {info.max_model_len}-token context; at most {room} "
            f"can be generated",
            field,
        )
    return requested


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """What a chat request asks to generate, and the field it was asked in."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def openai_params(
    body: OpenAISampling, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    fields = {name: _or(getattr(body, key), _DEFAULTS[name]) for name, key in _OPENAI.items()}
    spec, _ = structured_outputs_of(body)
    return SamplingParams(
        **fields,
        max_tokens=max_tokens,
        logprobs=logprobs,
        return_routed_experts=body.return_routed_experts,
        return_indexer_topk=body.return_indexer_topk,
        structured_outputs=spec,
    )


def structured_outputs_of(body: OpenAISampling) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint an OpenAI request asks for, and the field it asked in (errors the
    engine finds in it are named after that field)."""
    found = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if body.structured_outputs is not None:
        found.append(
            (
                structured_spec(dict(body.structured_outputs), "structured_outputs"),
                "structured_outputs",
            )
        )
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            found.append((structured_spec({kind: getattr(body, name)}, name), name))
    if len(found) > 1:
        raise bad_request(f"give one of {[f for _, f in found]}, not several", found[1][1])
    return found[0] if found else (None, "response_format")


def name_engine_errors(request, body: OpenAISampling) -> None:
    """Engine errors about the constraint (structured_outputs.json: ...) name the field the
    client sent it in (response_format, guided_json, ...): see errors.install_error_handlers."""
    _, field = structured_outputs_of(body)
    request.state.param_names = {f"structured_outputs.{kind}": field for kind in STRUCTURED_KINDS}


def _response_format(value: dict) -> StructuredOutputsParams | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format",
        )
    wrapper = value.get("json_schema")
    schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object "
            "({'type': 'json_schema', 'json_schema': {'name': ..., 'schema': "
            "{...}}})",
            "response_format",
        )
    # strict or not, the output follows the schema: constrained decoding has no looser mode
    return structured_spec({"json": schema}, "response_format")


def structured_spec(fields: dict, field: str) -> StructuredOutputsParams:
    """`{kind: value}` (StructuredOutputsParams fields) checked, errors naming `field`."""
    unknown = sorted(set(fields) - {*STRUCTURED_KINDS, "whitespace_flexible"})
    if unknown:
        raise bad_request(
            f"{field}: unknown keys {unknown}; use one of {list(STRUCTURED_KINDS)}", field
        )
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{field}: {str(e).removeprefix('SamplingParams.')}", field) from None


def sglang_params(
    sp: SGLangSamplingParams,
    max_tokens: int | None,
    logprobs: int | None,
    return_routed_experts: bool,
    return_indexer_topk: bool = False,
) -> SamplingParams:
    if sp.stop_regex:
        raise bad_request("stop_regex: stopping on a regex is not served; use stop", "stop_regex")
    fields = {name: getattr(sp, key) for name, key in _SGLANG.items()}
    for alias, name in ALIASES["sglang"].items():
        if fields[name] is None:
            fields[name] = getattr(sp, alias)
    return SamplingParams(
        **fields,
        max_tokens=max_tokens,
        logprobs=logprobs,
        return_routed_experts=return_routed_experts,
        return_indexer_topk=return_indexer_topk,
        structured_outputs=_sglang_spec(sp),
    )


def _sglang_spec(sp: SGLangSamplingParams) -> StructuredOutputsParams | None:
    given = {name: getattr(sp, name) for name in STRUCTURED_SGLANG}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise bad_request(f"give one of {sorted(given)}, not several", sorted(given)[1])
    if not given:
        return None
    ((name, value),) = given.items()
    return structured_spec({STRUCTURED_SGLANG[name]: value}, name)


def _or(value, default):
    return default if value is None else value
