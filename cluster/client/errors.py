"""What the rollout client raises, the same over HTTP and in the cluster.

A request the server refused as bad input is a `ValueError` (a `BadRequest` over HTTP, with the
server's message); a missing or wrong admin key is a `PermissionError`; a cluster that cannot
serve now (every replica busy, none ready, the engines paused past their queue) is `Busy`,
which the client retries for a while before raising.
"""

from __future__ import annotations


class ClientError(Exception):
    """The server answered with an error status (the OpenAI error body's fields)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class BadRequest(ClientError, ValueError):
    """400/404/413/422: the request itself is wrong; sending it again fails again."""


class Unauthorized(ClientError, PermissionError):
    """401 (no key) or 403 (a key without the rights, e.g. a user key on an admin route)."""


class Busy(ClientError):
    """429/503: no replica can take the request now; worth retrying later."""


class NoReplica(Exception):
    """In the cluster: the Router knows no replica that can serve."""


def from_status(status: int, body: object) -> ClientError:
    """The error for an HTTP answer; `body` the parsed JSON (or text) it carried."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(body)}
    kind = (
        BadRequest
        if status in (400, 404, 413, 422)
        else Unauthorized
        if status in (401, 403)
        else Busy
        if status in (429, 503)
        else ClientError
    )
    return kind(
        status, str(err.get("message", "")), err.get("type"), err.get("param"), err.get("code")
    )
