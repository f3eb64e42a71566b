"""Request bodies over `max_bytes` get 413 before a route parses them; paths matching one of
`path_limits`' patterns have their own limit instead (weight buckets are large).

A declared Content-Length over the limit is refused without parsing; otherwise the body is read
up to the limit (chunked uploads included) and replayed to the app. Before answering 413 the rest
of the upload is read and dropped (up to `DRAIN_BYTES`), so the client, still sending, can read
the answer instead of a connection reset.
"""

from __future__ import annotations

import re

from raylane.session_server.errors import error_response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DRAIN_BYTES = 256 << 20


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        # regex (matching the whole path) -> limit; the first that matches wins
        self.path_limits = [(re.compile(p), n) for p, n in (path_limits or {}).items()]

    def limit_for(self, path: str) -> int:
        return next((n for p, n in self.path_limits if p.fullmatch(path)), self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and _too_big(declared, limit):
            await _refuse(scope, receive, send, limit, drain=True)
            return
        messages = await _read(receive, limit)
        if _more(messages[-1]) or _size(messages) > limit:
            await _refuse(scope, receive, send, limit, drain=_more(messages[-1]))
            return
        await self.app(scope, _replay(messages, receive), send)


async def _read(receive: Receive, limit: int) -> list[Message]:
    """The body's messages: all of them, or those up to the first one past the limit."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages  # a disconnect: let the app see it
        size += len(message.get("body", b""))
        if size > limit or not _more(message):
            return messages


async def _refuse(scope: Scope, receive: Receive, send: Send, limit: int, drain: bool) -> None:
    if drain:
        await _drain(receive)
    response = error_response(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    await response(scope, receive, send)


def _more(message: Message) -> bool:
    return message["type"] == "http.request" and message.get("more_body", False)


def _size(messages: list[Message]) -> int:
    return sum(len(m.get("body", b"")) for m in messages)


async def _drain(receive: Receive) -> None:
    dropped = 0
    while dropped <= DRAIN_BYTES:
        message = await receive()
        if not _more(message):
            return
        dropped += len(message.get("body", b""))


def _too_big(declared: bytes, limit: int) -> bool:
    try:
        return int(declared) > limit
    except ValueError:
        return False  # a malformed header: the server rejects it, or the read below counts


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
