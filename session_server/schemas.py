"""Request bodies, validated at the edge: strict types (a string is not a number), unknown
top-level fields ignored as OpenAI does, SGLang's `sampling_params` checked by name."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 4096  # what the schema parses at all; the server's own limit is `build_app(max_n=)`
MAX_STOP = 64  # stop strings per request (each is matched against every new token's text)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; bounds what is parsed before the field is refused

StopList = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None
StopTokenIds = Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class OpenAISampling(_Body):
    """Fields the completion and chat APIs share, plus the vLLM-style extensions."""

    model: str | None = None
    lora_version: int | None = Field(None, ge=1)  # raylane's: that version of `model`'s adapter
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: StopList = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # seconds; past it the request ends with its partial output, finish reason "abort"
    timeout: float | None = Field(None, gt=0)
    # rejected when non-empty
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: StopTokenIds = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_routed_experts: bool = False
    return_indexer_topk: bool = False  # DSA models: the indexer's top-k positions
    # prefix-cache blocks are shared only between requests with the same salt
    cache_salt: str | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" instead of their text
    return_tokens_as_token_ids: bool = False
    # structured outputs: OpenAI's response_format ({"type": "text" | "json_object" |
    # "json_schema"}), vLLM's structured_outputs {json | json_object | regex | choice | grammar},
    # or vLLM's older guided_* fields; one of them per request
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (text and logprobs)
    # vLLM's: each prompt token's logprob, rank and the top-N beside it (0: the token alone)
    prompt_logprobs: int | None = None
    suffix: str | None = None  # rejected when set
    best_of: int | None = None  # only best_of == n


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it; extra keys (tool_calls, name, ...) pass through."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatTemplateFields(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatTemplateFields, OpenAISampling):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    # (session_server/tool_calls/choice.py); None: "auto" with tools, else "none"
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true


class CreateSessionRequest(_Body):
    metadata: dict[str, Any] | None = None


class SessionSampleRequest(_Body):
    max_seq_len: int | None = Field(None, ge=1)


class SGLangSamplingParams(BaseModel):
    """SGLang's sampling_params; an unknown name is a 400 naming it, so typos do not pass."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: StopList = None
    stop_token_ids: StopTokenIds = None
    stop_regex: str | list[str] | None = None  # SGLang's frontend sends it; only empty is served
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's own name for the seed
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True  # accepted; byte-level tokenizers ignore it
    # RL extensions: end as "stale" past this many weight versions; per-token kept mass
    max_weight_lag: int | None = Field(None, ge=0)
    return_kept_mass: bool = False
    # structured outputs (SGLang's names): a JSON schema (text), a regex, an EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


def _default_sampling() -> SGLangSamplingParams:
    return SGLangSamplingParams.model_validate({})


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=_default_sampling)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    return_indexer_topk: bool = False  # DSA models: base64 int32 with its shape, like routing
    # SGLang's: routed experts from this position on (in [0, prompt tokens])
    routed_experts_start_len: int = Field(0, ge=0)
    stream: bool = False
    rid: str | None = None
    routing_key: str | None = None
    timeout: float | None = Field(None, gt=0)  # seconds, as on the OpenAI routes
    # SGLang's: the adapter (its name) the request runs on; one per prompt, or one for all
    lora_path: str | list[str | None] | None = None
    lora_version: int | None = Field(None, ge=1)  # raylane's: that version of the adapter


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    text: str | None = None  # SGLang-style alias of prompt
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]
    add_special_tokens: bool | None = None  # default: True for text, False for messages


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


# --- the admin routes ------------------------------------------------------------------------


class PauseRequest(_Body):
    mode: str = "keep"  # "abort" | "wait" | "keep" | "retract"


class BeginUpdateRequest(_Body):
    version: int
    tensors: list[dict[str, Any]] = Field(min_length=1)  # {"name", "shape", "dtype"} each


class AbortRequest(_Body):
    request_ids: list[str]
