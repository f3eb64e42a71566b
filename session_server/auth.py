"""Optional API keys: every route but /health needs `Authorization: Bearer <key>`; the admin
routes (/admin/..., and the trainer protocols' routes that change state) need the admin key
instead, which user keys never open.

Keys are compared in constant time and never logged or echoed back.
"""

from __future__ import annotations

import hmac
import re

from raylane.session_server.errors import error_response
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})
ADMIN_PREFIX = "/admin/"
_SLASHES = re.compile(r"/{2,}")


def canonical_path(scope: Scope) -> str:
    """The path as the checks see it: repeated slashes collapsed, so `//admin/x` is checked
    as `/admin/x` (the server has already percent-decoded it)."""
    return _SLASHES.sub("/", scope["path"])


class ApiKeyAuth:
    """Pure ASGI middleware, so streamed responses and disconnects pass through untouched.

    Paths under `pass_prefixes` and in `pass_paths` go on unchecked: another middleware
    (`AdminAuth`) guards them, and the admin key, not being a user key, would be refused
    here."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: list[str],
        pass_prefixes: tuple[str, ...] = (),
        pass_paths: frozenset[str] = frozenset(),
    ):
        if not api_keys or any(not k for k in api_keys):
            raise ValueError("api_keys: give at least one non-empty key, or None for no auth")
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.pass_prefixes = pass_prefixes
        self.pass_paths = pass_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = canonical_path(scope) if scope["type"] == "http" else ""
        if (
            scope["type"] != "http"
            or path in OPEN_PATHS
            or path.startswith(self.pass_prefixes)
            or path in self.pass_paths
            or _matches(scope, self.keys)
        ):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class AdminAuth:
    """Guards /admin/ paths, and `paths` (the trainer protocols' state-changing routes), with
    the admin key: none is 401, any other key (a user key) 403.

    Runs before the body is read, so nobody without the key can make the server buffer a
    weight bucket."""

    def __init__(self, app: ASGIApp, admin_key: str, paths: frozenset[str] = frozenset()):
        if not admin_key:
            raise ValueError("admin_api_key: give a non-empty key, or None for no admin routes")
        self.app = app
        self.keys = [admin_key.encode()]
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = canonical_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or not (path.startswith(ADMIN_PREFIX) or path in self.paths):
            await self.app(scope, receive, send)
            return
        if _bearer(scope) is None:
            response = error_response(
                401,
                "the admin routes need the admin key: send it as "
                "'Authorization: Bearer <admin key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif not _matches(scope, self.keys):
            response = error_response(
                403,
                "this key may not use the admin routes; they need the admin key",
                code="forbidden",
            )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _bearer(scope: Scope) -> bytes | None:
    """The bearer token of the request, None when there is none."""
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def _matches(scope: Scope, keys: list[bytes]) -> bool:
    token = _bearer(scope)
    if token is None:
        return False
    # check every key, so the time taken does not tell which one nearly matched
    matches = [hmac.compare_digest(token, key) for key in keys]
    return any(matches)
