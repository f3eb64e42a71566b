"""Session routes: multi-turn agent conversations recorded token-in/token-out for RL training.

POST   /sessions                           -> {"session_id": ...}
GET    /sessions/{id}                      the metadata and the turn records (no blobs)
DELETE /sessions/{id}                      waits for the turn in flight, then forgets it
POST   /sessions/{id}/v1/chat/completions  OpenAI chat: an agent sets base_url=.../sessions/{id}/v1
POST   /sessions/{id}/samples              the merged training sample: JSON, or safetensors when
                                           `Accept` asks for application/octet-stream or
                                           application/safetensors
Errors are the OpenAI error body with the session error's status (404 unknown id, 400 bad turn
or rollback too deep, 409 a stored session of another model, 422 malformed trajectory).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from raylane.router.session import TurnDelta
from raylane.session_server.backend import SessionBackend
from raylane.session_server.context import backend_of, check_model, new_id, timeout_of
from raylane.session_server.errors import bad_request, from_exception
from raylane.session_server.formatting import finite
from raylane.session_server.lora import check_session_adapter
from raylane.session_server.openai_routes import check_chat
from raylane.session_server.openapi import BINARY, EVENT_STREAM, ok
from raylane.session_server.prompts import message_dicts
from raylane.session_server.response_schemas import (
    ChatCompletion,
    SessionCreated,
    SessionDeleted,
    SessionDescription,
    TrainingSample,
)
from raylane.session_server.sampling import chat_max_tokens, openai_params
from raylane.session_server.schemas import (
    ChatCompletionRequest,
    CreateSessionRequest,
    SessionSampleRequest,
)
from raylane.session_server.session_format import SessionChatFormatter
from raylane.session_server.streaming import Indexed, final_outputs, primed, sse_response

router = APIRouter(prefix="/sessions")
SAFETENSORS_TYPES = ("application/safetensors", "application/octet-stream")
_JSON_TYPES = ("application/json", "application/*", "*/*")


def sessions_of(request: Request) -> SessionBackend:
    return backend_of(request).sessions


@router.post("", response_model=None, responses=ok(SessionCreated))
async def create_session(request: Request, body: CreateSessionRequest | None = Body(None)) -> dict:
    metadata = body.metadata if body else None
    await check_session_adapter(request, metadata)  # metadata["lora"]: every turn's adapter
    session_id = await sessions_of(request).create(metadata)
    return {"session_id": session_id}


@router.get("/{session_id}", response_model=None, responses=ok(SessionDescription))
async def describe_session(session_id: str, request: Request) -> dict:
    return await sessions_of(request).describe(session_id)


@router.delete("/{session_id}", response_model=None, responses=ok(SessionDeleted))
async def delete_session(session_id: str, request: Request) -> dict:
    await sessions_of(request).delete(session_id)
    return {"session_id": session_id, "deleted": True}


@router.post("/{session_id}/v1/chat/completions", responses=ok(ChatCompletion, EVENT_STREAM))
async def session_chat(session_id: str, body: ChatCompletionRequest, request: Request):
    """One turn of the session: the OpenAI chat API, the reply recorded token-in/token-out.

    `timeout` (seconds; else the server's `request_timeout_s`) bounds the turn's generation,
    counted once the session's previous turn has ended: past it the generation is aborted on
    the engine and the turn ends with its partial output, finish reason "abort" (streamed or
    not). The session records that aborted turn, as it records one a control-plane abort ends:
    the reply the client got is the stored assistant message to echo next turn, its ids are
    loss-masked in as generated, and the sample's status is "aborted" while it is the last turn.
    The next turn continues after it (the template's end of turn appended, as after
    `max_tokens`). An aborted turn keeps no routed-expert blob; the next turn's covers it.
    """
    backend = backend_of(request)
    check_model(body.model, backend.info)
    check_chat(body)
    asked, field = _check_session_chat(body, backend.info.max_model_len)
    body = body.model_copy(update={"return_routed_experts": False})  # the record keeps them
    params = openai_params(body, asked, 0 if body.logprobs else None)
    formatter = SessionChatFormatter(
        new_id("chatcmpl"), backend.info.name, body, params, backend.tokenizer, 0
    )
    turn = backend.sessions.chat_deltas(
        session_id,
        message_dicts(body.messages),
        params,
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
        timeout_s=timeout_of(request, body.timeout),
        lora_version=body.lora_version,  # of the session's adapter (metadata["lora"])
    )
    stream = _views(turn, formatter, {"prompt": "messages", "max_tokens": field})
    if body.stream:
        return sse_response(await primed(request, stream), formatter.chunks, formatter.tail)
    return JSONResponse(formatter.response(await final_outputs(request, stream, 1)))


@router.post(
    "/{session_id}/samples", responses=ok(TrainingSample, dict.fromkeys(SAFETENSORS_TYPES, BINARY))
)
async def session_sample(
    session_id: str, request: Request, body: SessionSampleRequest | None = Body(None)
) -> Response:
    sample = await sessions_of(request).sample(session_id, body.max_seq_len if body else None)
    kind = safetensors_type(request.headers.get("accept", ""))
    if kind is not None:
        return Response(sample.to_safetensors(), media_type=kind)
    data = sample.to_json()
    data["rollout_logprobs"] = [finite(lp) for lp in data["rollout_logprobs"]]  # JSON has no inf
    return JSONResponse(data)


def safetensors_type(accept: str) -> str | None:
    """The safetensors media type `accept` asks for before any JSON one, else None."""
    for part in accept.split(","):
        kind = part.split(";")[0].strip().lower()
        if kind in SAFETENSORS_TYPES:
            return kind
        if kind in _JSON_TYPES:
            return None
    return None


def _check_session_chat(body: ChatCompletionRequest, max_model_len: int) -> tuple[int | None, str]:
    if body.continue_final_message or not body.add_generation_prompt:
        raise bad_request(
            "a session turn always ends with the model's reply: "
            "add_generation_prompt must be true and continue_final_message false",
            "add_generation_prompt",
        )
    if body.top_logprobs:
        raise bad_request(
            "top_logprobs is not supported on session routes; logprobs=true gives "
            "each generated token's logprob",
            "top_logprobs",
        )
    asked, field = chat_max_tokens(body)
    if asked is not None and asked >= max_model_len:
        raise bad_request(
            f"{field}: {asked} tokens leave no room for a prompt in the model's "
            f"{max_model_len}-token context",
            field,
        )
    return asked, field


async def _views(
    turn: AsyncGenerator[TurnDelta, None],
    formatter: SessionChatFormatter,
    param_names: dict[str, str],
) -> AsyncGenerator[Indexed, None]:
    """The turn as the chat formatter's (prompt index, output) stream; engine errors name the
    request's fields."""
    async with aclosing(turn):
        try:
            async for step in turn:
                yield 0, formatter.view(step)
        except ValueError as e:
            raise from_exception(e, param_names) from None
