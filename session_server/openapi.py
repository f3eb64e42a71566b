"""How routes declare their responses in the OpenAPI document: the 200 body's model and media
types (`ok`), and the OpenAI error body for every 4xx and 5xx (`ERRORS`, given to every router in
`build_app`, which also keeps FastAPI from documenting a 422 the app never sends)."""

from __future__ import annotations

from typing import Any

from raylane.session_server.response_schemas import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The OpenAI error body"},
    "5XX": {"model": ErrorResponse, "description": "The OpenAI error body"},
}
BINARY = {"schema": {"type": "string", "format": "binary"}}
EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": "With `stream: true`: server-sent events, one "
            "`data: {chunk}` per piece, then `data: [DONE]`",
        }
    }
}


def ok(
    model: Any = None,
    content: dict[str, Any] | None = None,
    description: str = "Successful Response",
) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route whose 200 body is `model` as JSON, and/or other `content`
    (media type -> OpenAPI media object). Routes pass `response_model=None` with it: they
    return their dicts as they are, and this only documents them."""
    entry: dict[str, Any] = {"description": description}
    if model is not None:
        entry["model"] = model
    if content:
        entry["content"] = content
    return {200: entry}
