"""Response bodies, for the OpenAPI document only: routes build plain dicts (the formatters) and
these models say what those dicts hold, so the schema clients and the fuzz test read is the body
the route really returns. A key that is always sent has no default (required, maybe null); a key
sent only in some cases has one (optional). Objects we build refuse other keys, so a renamed or
stray key fails tests/e2e/test_fuzz_schema.py; what the user sent (metadata, messages, params)
passes through as it is."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    """Every 4xx and 5xx with a body (session_server/errors.py)."""

    error: ErrorDetail


class RoutedExperts(_Out):
    """int32 little-endian expert ids, base64, and the array's shape."""

    data: str
    shape: list[int]


# --- OpenAI ----------------------------------------------------------------------------------


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    weight_version: int
    batch_invariant: bool  # raylane's: outputs bit-identical alone or in any batch


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # not on session turns


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(_Out):
    index: int
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    token_ids: list[int] | None = None  # return_token_ids
    routed_experts: RoutedExperts | None = None  # return_routed_experts (MoE models)
    indexer_topk: RoutedExperts | None = None  # return_indexer_topk (DSA models)


class PromptLogprob(_Out):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's


class _Head(_Out):
    id: str
    created: int
    model: str
    weight_version: int  # an extension: which weights answered


class Completion(_Head):
    object: Literal["text_completion"]
    system_fingerprint: None
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunction(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str | None = None  # a session's stored reply keeps what its parser gave
    type: str
    function: ToolCallFunction


class AssistantMessage(_Out):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # a session's reply is its stored message, which may keep these (router/messages.py)
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class ChatCompletion(_Head):
    object: Literal["chat.completion"]
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # return_token_ids (not on session turns)


# --- native ----------------------------------------------------------------------------------

SGLangLogprob = tuple[float, int, str | None]  # [logprob, token id, text or None]


class FinishReason(_Out):
    type: str  # "stop", "length", "abort", "stale", ...
    matched: int | str | None = None  # "stop": the stop string, or the stop (EOS) token id
    length: int | None = None  # "length": tokens generated
    message: str | None = None  # any other type


class MetaInfo(_Out):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: int | str  # a string (SGLang's type) while the trainer API is on
    weight_versions: list[int]  # of each output token
    # not on an admin abort's items; SGLang's base64 string while the trainer API is on
    routed_experts: RoutedExperts | str | None = None
    routed_experts_shape: list[int] | None = None  # with SGLang's string
    routed_experts_start_len: int | None = None  # with SGLang's string
    indexer_topk: RoutedExperts | None = None  # return_indexer_topk (DSA models)
    kept_mass_logprobs: list[float] | None = None  # return_kept_mass
    lora_versions: list[int] | None = None  # on a LoRA adapter: its version of each token
    output_token_logprobs: list[SGLangLogprob] | None = None  # return_logprob
    output_top_logprobs: list[list[SGLangLogprob]] | None = None  # and top_logprobs_num > 0


class GenerateItem(_Out):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None  # with several prompts or samples


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Out):
    prompt: str
    text: str  # the same text, under SGLang's name


# --- sessions --------------------------------------------------------------------------------


class SessionCreated(_Out):
    session_id: str


class SessionDeleted(_Out):
    session_id: str
    deleted: bool


class TurnRecord(_Out):
    """A turn as router/trajectory.py's `TurnRecord.to_dict` shows it (no blobs)."""

    new_messages: list[dict[str, Any]]
    reply: dict[str, Any]
    params: dict[str, Any]  # the turn's SamplingParams fields
    tools: list[dict[str, Any]] | None
    prefix_len: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    routed_experts_shape: list[int] | None
    routed_experts_dropped: bool  # the record's blobs (routed experts, indexer top-k) dropped
    indexer_topk_shape: list[int] | None = None


class SessionDescription(_Out):
    session_id: str
    created_at: float  # unix seconds
    metadata: dict[str, Any]
    model: str | None = None  # the served model that made it (None: not recorded)
    num_turns: int
    num_tokens: int
    messages: list[dict[str, Any]]
    records: list[TurnRecord]


class TrainingSample(_Out):
    """router/samples.py's `TrainingSample.to_json` (the safetensors form holds the same)."""

    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    routed_experts: RoutedExperts | None
    weight_versions: list[int]
    status: Literal["completed", "truncated", "aborted"]
    indexer_topk: RoutedExperts | None = None  # DSA models


# --- admin -----------------------------------------------------------------------------------


class ControlState(_Out):
    paused: bool
    mode: str | None = None  # while paused
    weight_version: int
    weight_label: str | None = None  # a trainer protocol's label for it, where one was given


class UpdateBegun(_Out):
    update_id: str


class BucketLoaded(_Out):
    tensors: int  # how many the bucket held


class WeightVersion(_Out):
    weight_version: int
    weight_label: str | None = None  # a trainer protocol's label for it, where one was given


class Aborted(_Out):
    outputs: list[GenerateItem]  # every sample of every request it ended


class CacheFlushed(_Out):
    flushed: bool
