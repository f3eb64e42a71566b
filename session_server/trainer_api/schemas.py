"""Request and response bodies of the trainer protocols, in the peers' own names and shapes.
Requests ignore fields they do not know (the peers' clients send more than raylane needs);
responses are documented for the OpenAPI schema and the fuzz test, as raylane's own are."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from raylane.session_server.response_schemas import PromptLogprob, Usage, _Out


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --- vLLM's RL API ---------------------------------------------------------------------------


class AbortRequestsBody(_Body):
    request_ids: list[str] | None = None  # none or empty: every request


class UpdateWeightVersionBody(_Body):
    """vLLM's and SGLang's /update_weight_version (the same path and field)."""

    new_version: str | int
    abort_all_requests: bool = False  # SGLang's


class Status(_Out):
    status: str


class IsPaused(_Out):
    is_paused: bool


class WorldSize(_Out):
    world_size: int


class WeightVersionText(_Out):
    weight_version: str


class Aborted(_Out):
    status: Literal["aborted"]
    aborted: int  # requests ended


class VersionUpdated(_Out):
    success: bool
    message: str
    new_version: str


class TokensRequest(_Body):
    """vLLM's /inference/v1/generate body (multimodal `features` are not taken)."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # vLLM's SamplingParams
    request_id: str | None = None
    model: str | None = None
    lora_version: int | None = Field(None, ge=1)  # raylane's: that version of `model`'s adapter
    stream: bool | None = False
    cache_salt: str | None = None
    priority: int = 0
    routed_experts_start_len: int = Field(0, ge=0)  # raylane's: routed experts from here on
    features: dict[str, Any] | None = None  # multimodal inputs: refused (text models only)


class TokenLogprob(_Out):
    token: str  # "token_id:<id>"
    logprob: float
    bytes: list[int] | None


class TokenLogprobs(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class TokensLogprobs(_Out):
    content: list[TokenLogprobs]


class TokensChoice(_Out):
    index: int
    logprobs: TokensLogprobs | None
    finish_reason: str
    token_ids: list[int]
    routed_experts: str | None  # base64 of a .npy int32 [tokens - 1 - start, layers, top_k]


class TokensResponse(_Out):
    request_id: str
    choices: list[TokensChoice]
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None  # vLLM's
    kv_transfer_params: None
    usage: Usage
    weight_version: str  # the label of the version the tokens came from (else the integer)


class IsSleeping(_Out):
    is_sleeping: bool


class CheckerBody(_Body):
    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None  # "compare": the checksums to compare against


class CheckerResult(_Out):
    checksums: dict[str, str] | None = None  # "checksum"
    status: str | None = None  # "reset"
    match: bool | None = None  # "compare"
    mismatches: list[str] | None = None  # "compare"


# --- SGLang's native API ---------------------------------------------------------------------


SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequestBody(_Body):
    rid: str = ""
    abort_all: bool = False


class Message(_Out):
    message: str
    status: str


class ServerInfo(BaseModel):
    """SGLang's server arguments that trainers compare against their own (slime: tp_size,
    dp_size, ...), with `vllm_config` for vLLM's clients of the same path; more keys may come."""

    model_config = ConfigDict(extra="allow")
    model_path: str
    served_model_name: str
    tp_size: int
    dp_size: int
    pp_size: int
    ep_size: int
    dtype: str
    context_length: int
    enable_return_routed_experts: bool
    enable_deterministic_inference: bool
    batch_invariant: bool
    weight_version: str
    version: str
    vllm_config: dict[str, Any]


class ModelInfoAnswer(BaseModel):
    """SGLang's /model_info: what it serves (its frontend reads `model_path`)."""

    model_config = ConfigDict(extra="allow")
    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool
    preferred_sampling_params: dict[str, Any] | None
    weight_version: str
    has_image_understanding: bool
    has_audio_understanding: bool


class Load(_Out):
    dp_rank: int  # the replica's index (raylane's replicas are SGLang's DP ranks)
    num_running_reqs: int
    num_waiting_reqs: int
    token_usage: float  # fraction of the KV cache in use


class Loads(_Out):
    timestamp: str
    dp_rank_count: int
    loads: list[Load]


class UpdateFromDiskBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | int | None = None
    abort_all_requests: bool = False


class UpdateResult(_Out):
    success: bool
    message: str
    num_paused_requests: int = 0


class SGLangCheckerBody(_Body):
    action: Literal["snapshot", "reset_tensors", "compare", "checksum"]


class SGLangCheckerResult(_Out):
    success: bool
    message: str
    checksums: dict[str, str] | None = None  # "checksum"
    mismatches: list[str] | None = None  # "compare"
