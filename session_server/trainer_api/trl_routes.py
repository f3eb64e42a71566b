"""The routes of TRL's former `trl vllm-serve` server (TRL up to 0.29; `GRPOTrainer(vllm_mode=
"server")` with those versions), with their trailing slashes. TRL's current `VLLMClient` speaks
vLLM's own API instead (`vllm_routes` and the OpenAI routes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field
from raylane.actors.engine.outputs import CompletionOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server import formatting as fmt
from raylane.session_server.context import backend_of, check_n, new_id, timeout_of
from raylane.session_server.errors import APIError, bad_request
from raylane.session_server.openapi import ok
from raylane.session_server.prompts import encode, render_chat
from raylane.session_server.response_schemas import _Out
from raylane.session_server.sampling import resolve_max_tokens, structured_spec
from raylane.session_server.schemas import ChatMessage, ChatTemplateFields
from raylane.session_server.streaming import final_outputs, start
from raylane.session_server.trainer_api.common import (
    SAMPLING_FIELDS,
    commit_open_update,
    control_of,
    info_of,
    world_size,
)
from raylane.session_server.trainer_api.schemas import WorldSize, _Body

router = APIRouter(tags=["TRL vllm-serve"])
control = APIRouter(tags=["TRL vllm-serve"])


class Health(_Out):
    status: str


class TensorParallelSize(_Out):
    tensor_parallel_size: int


class Done(_Out):
    message: str


@router.get("/health/", response_model=None, responses=ok(Health))
async def health(request: Request) -> dict:
    if not await backend_of(request).ready():
        raise APIError(503, "no engine replica is ready", code="not_ready")
    return {"status": "ok"}


@router.get("/get_world_size/", response_model=None, responses=ok(WorldSize))
async def get_world_size(request: Request) -> dict:
    return {"world_size": world_size(info_of(request))}


@router.get("/get_tensor_parallel_size/", response_model=None, responses=ok(TensorParallelSize))
async def get_tensor_parallel_size(request: Request) -> dict:
    return {"tensor_parallel_size": info_of(request).tensor_parallel_size}


@control.post("/reset_prefix_cache/", response_model=None, responses=ok(Done))
async def reset_prefix_cache(request: Request) -> dict:
    """TRL's trainers call this after the last `/update_named_param/`: it commits the update
    those opened (trl_weights.py), if one is open, then flushes."""
    ctl = control_of(request)
    await commit_open_update(ctl)
    await ctl.flush_cache()
    return {"message": "Request received, resetting prefix cache status: True"}


class _Sampling(_Body):
    """The sampling fields of TRL's former server (vLLM's names and TRL's defaults)."""

    n: int = Field(1, ge=1)
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    guided_decoding_regex: str | None = None
    structured_outputs_regex: str | None = None  # TRL >= 0.25's name for it
    # TRL >= 0.25: the top N of each token, sent always; it selects that version's answer
    logprobs: int | None = Field(None, ge=0, le=20)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the last N prompt tokens
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)  # more vLLM fields


class TRLGenerateRequest(_Sampling):
    prompts: list[str] | list[list[int]] = Field(min_length=1)  # token ids: TRL >= 0.25
    images: list[Any] | None = None  # refused unless all null


class TRLChatRequest(_Sampling):
    messages: list[list[ChatMessage]] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class Completions(_Out):
    prompt_ids: list[list[int]]  # one per prompt
    completion_ids: list[list[int]]  # n per prompt, prompt-major
    # TRL up to 0.24: each token's own logprob; TRL >= 0.25 (`logprobs` sent): per token the
    # top N and the sampled token, most likely first, their ids in `logprob_token_ids`
    logprobs: list[list[float]] | list[list[list[float]]]
    logprob_token_ids: list[list[list[int]]] | None = None


@router.post("/generate/", response_model=None, responses=ok(Completions))
async def generate(body: TRLGenerateRequest, request: Request) -> dict:
    if body.images and any(i is not None for i in body.images):
        raise bad_request("images: multimodal prompts are not served here", "images")
    tokenizer = backend_of(request).tokenizer
    prompts = [p if isinstance(p, list) else encode(tokenizer, p, "prompts") for p in body.prompts]
    return await _complete(request, prompts, body)


@router.post("/chat/", response_model=None, responses=ok(Completions))
async def chat(body: TRLChatRequest, request: Request) -> dict:
    tokenizer = backend_of(request).tokenizer
    prompts = [
        render_chat(
            tokenizer,
            ChatTemplateFields(messages=m, chat_template_kwargs=body.chat_template_kwargs),
        )
        for m in body.messages
    ]
    return await _complete(request, prompts, body)


async def _complete(request: Request, prompts: list[list[int]], body: _Sampling) -> dict:
    """Every prompt's n completions, prompt-major, with the raw logprobs of each token."""
    backend = backend_of(request)
    check_n(request, body.n)
    if body.truncate_prompt_tokens is not None:
        prompts = [p[-body.truncate_prompt_tokens :] for p in prompts]
    params = _params(body, prompts, backend.info)
    stream = start(backend, prompts, params, new_id("trl"), None, timeout_of(request, None))
    finals = await final_outputs(request, stream, len(prompts))
    outs = [finals[i] for i in sorted(finals)]
    samples = [c for out in outs for c in out.outputs]
    answer: dict[str, Any] = {
        "prompt_ids": [list(out.prompt_token_ids) for out in outs],
        "completion_ids": [list(c.token_ids) for c in samples],
    }
    if "logprobs" not in body.model_fields_set:  # TRL up to 0.24
        return {**answer, "logprobs": [list(c.logprobs or []) for c in samples]}
    ranked = [_ranked(c) for c in samples]
    answer["logprobs"] = [[[lp for _, lp in pos] for pos in seq] for seq in ranked]
    answer["logprob_token_ids"] = [[[t for t, _ in pos] for pos in seq] for seq in ranked]
    return answer


def _ranked(c: CompletionOutput) -> list[list[tuple[int, float]]]:
    """Per token the top N, most likely first, then the sampled token if it is not among
    them (as vLLM ranks its logprobs: the sampled token's rank is its own)."""
    out = []
    for i, token in enumerate(c.token_ids):
        tops = sorted((c.top_logprobs or [{}])[i].items(), key=lambda kv: -kv[1])
        if token not in dict(tops):
            tops.append((token, (c.logprobs or [])[i]))
        out.append([(t, fmt.finite(lp)) for t, lp in tops])
    return out


def _params(body: _Sampling, prompts: list[list[int]], info) -> SamplingParams:
    extra = dict(body.generation_kwargs)
    unknown = sorted(set(extra) - SAMPLING_FIELDS - {"structured_outputs"})
    if unknown:
        raise bad_request(
            f"generation_kwargs: {unknown} are not sampling fields", "generation_kwargs"
        )
    fields = body.model_dump(exclude={"prompts", "messages", "images", "chat_template_kwargs"})
    for name in (
        "guided_decoding_regex",
        "structured_outputs_regex",
        "logprobs",
        "truncate_prompt_tokens",
        "generation_kwargs",
    ):
        fields.pop(name)
    fields["max_tokens"] = resolve_max_tokens(
        fields["max_tokens"], prompts, info, "max_tokens", "prompts"
    )
    regex = body.guided_decoding_regex or body.structured_outputs_regex
    spec = structured_spec({"regex": regex}, "guided_decoding_regex") if regex else None
    top = body.logprobs or 0
    return SamplingParams(**{**fields, **extra, "logprobs": top, "structured_outputs": spec})
