"""The one table of sampling-field names: each `SamplingParams` field as the OpenAI body (with
vLLM's extensions) and SGLang's `/generate` body spell it.

The HTTP routes read request bodies through it and the rollout client writes them through it,
so a field's outside names are written here once. Plain data: no torch, no pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    """How the APIs name one `SamplingParams` field (None: that API does not carry it)."""

    field: str
    openai: str | None  # OpenAI /v1/completions and /v1/chat/completions (vLLM's extensions)
    sglang: str | None  # SGLang /generate, inside `sampling_params` unless `sglang_top`
    # the body's value becomes the field unchanged (an OpenAI null: the SamplingParams default);
    # False: the route derives it (max_tokens checked against the context, logprobs from the
    # API's own switches, ...)
    copied: bool = True
    sglang_top: bool = False  # SGLang carries it at the top of the body, beside sampling_params


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("n", "n", "n"),
    Spelling("temperature", "temperature", "temperature"),
    Spelling("top_p", "top_p", "top_p"),
    Spelling("top_k", "top_k", "top_k"),
    Spelling("min_p", "min_p", "min_p"),
    Spelling("repetition_penalty", "repetition_penalty", "repetition_penalty"),
    Spelling("presence_penalty", "presence_penalty", "presence_penalty"),
    Spelling("frequency_penalty", "frequency_penalty", "frequency_penalty"),
    Spelling("seed", "seed", "seed"),  # SGLang's `sampling_seed` is an alias (ALIASES)
    Spelling("min_tokens", "min_tokens", "min_new_tokens"),
    Spelling("stop", "stop", "stop"),
    Spelling("stop_token_ids", "stop_token_ids", "stop_token_ids"),
    Spelling("ignore_eos", "ignore_eos", "ignore_eos"),
    Spelling("include_stop_str_in_output", "include_stop_str_in_output", "no_stop_trim"),
    Spelling("skip_special_tokens", "skip_special_tokens", "skip_special_tokens"),
    Spelling("max_weight_lag", None, "max_weight_lag"),
    Spelling("cache_salt", "cache_salt", None),
    Spelling("return_kept_mass", None, "return_kept_mass"),
    # chat also takes `max_completion_tokens`; None asks for the rest of the context
    Spelling("max_tokens", "max_tokens", "max_new_tokens", copied=False),
    # chat: `logprobs` is a switch and `top_logprobs` the count; SGLang: `return_logprob` is
    # the switch and `top_logprobs_num` the count
    Spelling("logprobs", "logprobs", "top_logprobs_num", copied=False, sglang_top=True),
    Spelling(
        "return_routed_experts",
        "return_routed_experts",
        "return_routed_experts",
        copied=False,
        sglang_top=True,
    ),
    Spelling(
        "return_indexer_topk",
        "return_indexer_topk",
        "return_indexer_topk",
        copied=False,
        sglang_top=True,
    ),
    # OpenAI: `response_format`, vLLM: `structured_outputs` or `guided_*` (GUIDED);
    # SGLang: STRUCTURED_SGLANG
    Spelling("structured_outputs", "structured_outputs", None, copied=False),
    # no body field: /v1/completions with echo asks for it through `logprobs`
    Spelling("prompt_logprobs", None, None, copied=False),
    # the offline engine's (vLLM's): HTTP answers stream deltas and shape each response
    Spelling("output_kind", None, None, copied=False),
)
BY_FIELD = {s.field: s for s in SPELLINGS}

# other names an API accepts for a field
ALIASES = {"sglang": {"sampling_seed": "seed"}}
# structured-output kinds (StructuredOutputsParams fields) under each API's own names
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_SGLANG = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def copied_fields(api: str) -> dict[str, str]:
    """SamplingParams field -> the `api`'s name ("openai" or "sglang"), for the fields whose
    value passes through unchanged."""
    return {s.field: getattr(s, api) for s in SPELLINGS if s.copied and getattr(s, api) is not None}


def sglang_error_names() -> dict[str, str]:
    """Engine field -> SGLang field, so a /generate error names what the client sent."""
    names = {s.field: s.sglang for s in SPELLINGS if s.sglang and s.sglang != s.field}
    names.update({f"structured_outputs.{k}": name for name, k in STRUCTURED_SGLANG.items()})
    names["prompt"] = "input_ids"
    return names
