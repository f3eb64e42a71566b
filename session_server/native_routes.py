"""Native routes: SGLang-style POST /generate, POST /tokenize, POST /detokenize, GET /health."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server.backend import ModelInfo
from raylane.session_server.context import (
    backend_of,
    check_n,
    new_id,
    routing_key,
    timeout_of,
)
from raylane.session_server.errors import bad_request, error_response, from_exception
from raylane.session_server.lora import model_adapter, on_adapter, sglang_adapter
from raylane.session_server.native_format import NativeFormatter
from raylane.session_server.openapi import EVENT_STREAM, ok
from raylane.session_server.prompts import chat_text, encode, generate_prompts
from raylane.session_server.response_schemas import (
    DetokenizeResponse,
    GenerateItem,
    TokenizeResponse,
)
from raylane.session_server.sampling import SGLANG_NAMES, resolve_max_tokens, sglang_params
from raylane.session_server.schemas import DetokenizeRequest, GenerateRequest, TokenizeRequest
from raylane.session_server.streaming import Indexed, final_outputs, primed, sse_response, start
from raylane.session_server.weight_labels import labels_of_app

router = APIRouter()


# one item per sample, a list when the request is batched or n > 1
@router.post("/generate", responses=ok(GenerateItem | list[GenerateItem], EVENT_STREAM))
async def generate(body: GenerateRequest, request: Request):
    backend = backend_of(request)
    check_n(request, body.sampling_params.n)
    prompts, batched = generate_prompts(body.text, body.input_ids, backend.tokenizer)
    try:
        params = _params(body, prompts, backend.info)
        _check_routing_start(body.routed_experts_start_len, prompts)
        # with the trainer API on, SGLang's shape: versions by their labels
        state = request.app.state
        labels = labels_of_app(request.app) if state.trainer_api else None
        formatter = NativeFormatter(
            body.rid or new_id("gen"), body, params, backend.tokenizer, len(prompts), labels
        )
        lora = await sglang_adapter(request, body.lora_path, len(prompts), body.lora_version)
        stream = start(
            on_adapter(backend, lora),
            prompts,
            params,
            formatter.id,
            routing_key(request, body.routing_key),
            timeout_of(request, body.timeout),
        )
        if labels is not None:
            stream = labels.resolved(stream)
        if body.stream:
            return sse_response(await primed(request, _renamed(stream)), formatter.chunks, list)
        items = formatter.items(await final_outputs(request, _renamed(stream), len(prompts)))
    except ValueError as e:
        raise from_exception(e, SGLANG_NAMES) from None
    return JSONResponse(items if batched or params.n > 1 else items[0])


def _params(body: GenerateRequest, prompts: list[list[int]], info: ModelInfo) -> SamplingParams:
    """The request's `SamplingParams` (SGLang's names; max_new_tokens bounded by the model)."""
    max_tokens = resolve_max_tokens(
        body.sampling_params.max_new_tokens,
        prompts,
        info,
        "max_new_tokens",
        "text" if body.text is not None else "input_ids",
    )
    return sglang_params(
        body.sampling_params,
        max_tokens,
        body.top_logprobs_num if body.return_logprob else None,
        body.return_routed_experts,
        body.return_indexer_topk,
    )


def _check_routing_start(start: int, prompts: list[list[int]]) -> None:
    shortest = min(len(p) for p in prompts)
    if start > shortest:
        raise bad_request(
            f"routed_experts_start_len: {start} is past the prompt ({shortest} tokens)",
            "routed_experts_start_len",
        )


async def _renamed(stream: AsyncGenerator[Indexed, None]) -> AsyncGenerator[Indexed, None]:
    """Engine errors name SGLang's fields (max_new_tokens, not max_tokens)."""
    async with aclosing(stream):
        try:
            async for item in stream:
                yield item
        except ValueError as e:
            raise from_exception(e, SGLANG_NAMES) from None


@router.post("/tokenize", response_model=None, responses=ok(TokenizeResponse))
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    backend = backend_of(request)
    await model_adapter(request, body.model)  # an adapter's name too: its tokenizer is the base's
    text = body.prompt if body.prompt is not None else body.text
    if (text is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages: must not be empty", "messages")
        text = chat_text(backend.tokenizer, body)
    special = body.add_special_tokens
    if special is None:
        special = body.messages is None
    ids = encode(backend.tokenizer, text, "prompt", special) if text else []
    return {
        "count": len(ids),
        "max_model_len": backend.info.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }


@router.post("/detokenize", response_model=None, responses=ok(DetokenizeResponse))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    backend = backend_of(request)
    await model_adapter(request, body.model)
    vocab = backend.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens: ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
    text = backend.tokenizer.decode(body.tokens, skip_special_tokens=body.skip_special_tokens)
    return {"prompt": text, "text": text}


@router.get(
    "/health",
    response_class=Response,
    responses=ok(description="Ready: an empty body (503 when no replica can serve)"),
)
async def health(request: Request) -> Response:
    try:
        ready = await backend_of(request).ready()
    except Exception as e:  # noqa: BLE001 - any failure to answer means not ready
        return error_response(503, f"health check failed: {type(e).__name__}", code="not_ready")
    if not ready:
        return error_response(503, "no engine replica is ready", code="not_ready")
    return Response(status_code=200)
