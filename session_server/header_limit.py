"""Requests with too many headers, or too many header bytes, get 431 before anything parses
them: header floods are a memory-exhaustion attack on servers that keep every header (vLLM's
CVE-2025-48956).
"""

from __future__ import annotations

from raylane.session_server.errors import error_response
from starlette.types import ASGIApp, Receive, Scope, Send

MAX_HEADER_COUNT = 100
MAX_HEADER_BYTES = 64 << 10  # names and values together


class HeaderLimit:
    def __init__(
        self, app: ASGIApp, max_count: int = MAX_HEADER_COUNT, max_bytes: int = MAX_HEADER_BYTES
    ):
        if max_count < 1 or max_bytes < 1:
            raise ValueError("max_header_count and max_header_bytes must be >= 1")
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) for name, value in headers)
            if len(headers) > self.max_count or size > self.max_bytes:
                response = error_response(
                    431,
                    f"request headers too large: {len(headers)} headers, {size} bytes "
                    f"(at most {self.max_count} headers and {self.max_bytes} bytes)",
                    code="headers_too_large",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
