"""Optional API keys: every route but /health needs `Authorization: Bearer <key>`.

Keys are compared in constant time and never logged or echoed back.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from session_server.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class ApiKeyAuth:
    """Pure ASGI middleware, so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        if not api_keys or any(not k for k in api_keys):
            raise ValueError("api_keys: give at least one non-empty key, or None for no auth")
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "Incorrect or missing API key: send it as "
                                  "'Authorization: Bearer <key>'", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # check every key, so the time taken does not tell which one nearly matched
        matches = [hmac.compare_digest(token, key) for key in self.keys]
        return any(matches)
