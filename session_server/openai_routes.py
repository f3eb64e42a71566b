"""The OpenAI API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from raylane.session_server.context import (
    backend_of,
    check_n,
    new_id,
    routing_key,
    timeout_of,
)
from raylane.session_server.errors import bad_request
from raylane.session_server.lora import adapter_cards, model_adapter, on_adapter
from raylane.session_server.openai_format import ChatFormatter, CompletionFormatter, Echo
from raylane.session_server.openapi import EVENT_STREAM, ok
from raylane.session_server.prompts import completion_prompts, render_chat
from raylane.session_server.response_schemas import ChatCompletion, Completion, ModelCard, ModelList
from raylane.session_server.sampling import (
    chat_max_tokens,
    name_engine_errors,
    openai_params,
    resolve_max_tokens,
)
from raylane.session_server.schemas import ChatCompletionRequest, CompletionRequest
from raylane.session_server.streaming import final_outputs, primed, sse_response, start
from raylane.session_server.tool_calls.choice import tool_plan

router = APIRouter()


@router.get("/v1/models", response_model=None, responses=ok(ModelList))
async def list_models(request: Request) -> dict:
    cards = await adapter_cards(request, request.app.state.created)
    return {"object": "list", "data": [await _model_card(request), *cards]}


@router.get("/v1/models/{model_id:path}", response_model=None, responses=ok(ModelCard))
async def retrieve_model(model_id: str, request: Request) -> dict:
    if await model_adapter(request, model_id) is not None:
        cards = await adapter_cards(request, request.app.state.created)
        return next(c for c in cards if c["id"] == model_id)
    return await _model_card(request)


async def _model_card(request: Request) -> dict:
    backend = backend_of(request)
    info = backend.info
    return {
        "id": info.name,
        "object": "model",
        "created": request.app.state.created,
        "owned_by": "raylane",
        "root": info.name,
        "parent": None,
        "max_model_len": info.max_model_len,
        "weight_version": await backend.control.weight_version(),
        "batch_invariant": info.batch_invariant,  # raylane's: outputs independent of batching
    }


@router.post("/v1/completions", responses=ok(Completion, EVENT_STREAM))
async def completions(body: CompletionRequest, request: Request):
    backend = backend_of(request)
    lora = await model_adapter(request, body.model, body.lora_version)  # None: base
    check_n(request, body.n)
    _reject_unsupported(body)
    prompts = completion_prompts(body.prompt, backend.tokenizer)
    echo = _echo(body, prompts, backend.tokenizer, backend.info.vocab_size)
    # max_tokens 0 (echo only): the engine needs max_tokens >= 1, so run with 1; the formatter
    # drops that token (Echo.prompt_only)
    asked = 1 if echo is not None and echo.prompt_only else body.max_tokens
    max_tokens = resolve_max_tokens(asked, prompts, backend.info, "max_tokens", "prompt")
    params = openai_params(body, max_tokens, body.logprobs)
    name_engine_errors(request, body)
    if echo is not None and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    if body.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.prompt_logprobs)
    formatter = CompletionFormatter(
        new_id("cmpl"),
        lora or backend.info.name,
        body,
        params,
        backend.tokenizer,
        body.logprobs or 0,
        echo=echo,
    )
    stream = start(
        on_adapter(backend, lora),
        prompts,
        params,
        formatter.id,
        routing_key(request, body.user),
        timeout_of(request, body.timeout),
    )
    if body.stream:
        return sse_response(await primed(request, stream), formatter.chunks, formatter.tail)
    return JSONResponse(formatter.response(await final_outputs(request, stream, len(prompts))))


@router.post("/v1/chat/completions", responses=ok(ChatCompletion, EVENT_STREAM))
async def chat_completions(body: ChatCompletionRequest, request: Request):
    backend = backend_of(request)
    lora = await model_adapter(request, body.model, body.lora_version)  # None: base
    check_n(request, body.n)
    check_chat(body)
    tools = tool_plan(body, request.app.state.tool_call_parser)  # None: no calls to read
    prompt = render_chat(backend.tokenizer, body)
    asked, field = chat_max_tokens(body)
    max_tokens = resolve_max_tokens(asked, [prompt], backend.info, field, "messages")
    num_top = body.top_logprobs or 0
    params = openai_params(body, max_tokens, num_top if body.logprobs else None)
    name_engine_errors(request, body)
    if tools is not None:
        params = tools.constrain(params, request)
    formatter = ChatFormatter(
        new_id("chatcmpl"),
        lora or backend.info.name,
        body,
        params,
        backend.tokenizer,
        num_top,
        tools=tools,
    )
    stream = start(
        on_adapter(backend, lora),
        [prompt],
        params,
        formatter.id,
        routing_key(request, body.user),
        timeout_of(request, body.timeout),
    )
    if body.stream:
        return sse_response(await primed(request, stream), formatter.chunks, formatter.tail)
    return JSONResponse(formatter.response(await final_outputs(request, stream, 1)))


def _echo(
    body: CompletionRequest, prompts: list[list[int]], tokenizer, vocab_size: int
) -> Echo | None:
    """What `echo: true` puts before each completion: the prompt as sent (token ids decoded)."""
    if not body.echo:
        return None
    if isinstance(body.prompt, str):
        texts = [body.prompt]
    elif isinstance(body.prompt[0], str):
        texts = list(body.prompt)
    else:  # ids are decoded before the engine checks them: a bad one must be a 400 here
        bad = [t for p in prompts for t in p if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(
                f"prompt: token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt"
            )
        texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    return Echo(texts, prompt_only=body.max_tokens == 0)


def _reject_unsupported(body: CompletionRequest) -> None:
    if body.echo and body.max_tokens == 0 and body.min_tokens:
        raise bad_request("min_tokens must be 0 when max_tokens is 0", "min_tokens")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of ranking is not supported)", "best_of")
    _check_prompt_logprobs(body)


def _check_prompt_logprobs(body: CompletionRequest) -> None:
    wanted = body.prompt_logprobs
    if wanted is None:
        return
    if not 0 <= wanted <= 20:
        raise bad_request("prompt_logprobs must be in [0, 20]", "prompt_logprobs")
    if body.stream:
        raise bad_request("prompt_logprobs: not served with stream=true", "prompt_logprobs")
    if body.echo and body.logprobs is not None and body.logprobs != wanted:
        raise bad_request(
            "prompt_logprobs must equal logprobs when echo returns the prompt's logprobs too",
            "prompt_logprobs",
        )


def check_chat(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
