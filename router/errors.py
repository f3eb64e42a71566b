"""Exceptions of the Router's session registry and control plane, each carrying the HTTP
status it maps to.

The HTTP layer turns any `RouterError` into an OpenAI error body
`{"error": {"message": str(e), "type": e.error_type, "param": e.param, "code": e.code}}`
with status `e.status`; everything else it lets through as a 5xx. Errors pickle (Ray ships
them from the Router actor to the ingress) whatever their subclass's `__init__` takes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


class RouterError(Exception):
    """Base class of the errors the Router raises on purpose."""

    status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @property
    def code(self) -> str:
        """The class name in snake case: "session_not_found", "rollback_too_deep", ..."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def __reduce__(self) -> tuple:
        # the default rebuilds with `cls(*args)`, which breaks for subclasses whose __init__
        # takes other arguments (SessionNotFound, RollbackTooDeep): rebuild from the state
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[RouterError], args: tuple, state: dict[str, Any]) -> RouterError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class SessionError(RouterError):
    """Base class of the errors the session registry raises on purpose."""


class SessionNotFound(SessionError):
    """No session with that id: never created, or already deleted."""

    status = 404
    error_type = "not_found_error"

    def __init__(self, session_id: str, expired: str | None = None) -> None:
        why = (
            f"expired ({expired}); start a new session"
            if expired
            else "does not exist (never created, or deleted)"
        )
        super().__init__(f"session {session_id!r} {why}")
        self.session_id = session_id


class TooManySessions(SessionError):
    """Every live session is in a turn and the registry is at `max_sessions`."""

    status = 429
    error_type = "rate_limit_error"


class BadSessionRequest(SessionError):
    """The turn cannot be served as sent (bad role, nothing new to answer, n > 1, ...)."""

    status = 400
    error_type = "invalid_request_error"


class BadRole(BadSessionRequest):
    """A message's role cannot appear where it was sent, or the chat template rejects it."""


class RollbackTooDeep(BadSessionRequest):
    """The messages diverge further back than `max_rollback_steps` generated turns."""

    def __init__(self, discarded: int, limit: int) -> None:
        super().__init__(
            f"the messages diverge from the stored conversation {discarded} generated turns "
            f"back, but at most {limit} may be discarded (max_rollback_steps); start a new "
            f"session for a different conversation",
            param="messages",
        )
        self.discarded = discarded
        self.limit = limit


class MalformedTrajectory(SessionError):
    """The stored turns cannot be merged into one training sample; the message says why."""

    status = 422
    error_type = "invalid_request_error"


class SessionModelMismatch(SessionError):
    """A stored session was recorded with another model than the one served now (the app was
    redeployed): its ids follow that model's chat template and tokenizer."""

    status = 409
    error_type = "invalid_request_error"

    def __init__(self, session_id: str, recorded: str, served: str) -> None:
        super().__init__(
            f"session {session_id!r} was recorded with model {recorded!r}, but this server "
            f"serves {served!r}; a session continues only with the model that made it (its "
            f"token ids follow that model's chat template): start a new session, or serve "
            f"{recorded!r} to continue it"
        )
        self.session_id = session_id
        self.recorded = recorded
        self.served = served


class SessionStoreUnavailable(SessionError):
    """The session store (PostgreSQL) could not be read or written; nothing was lost that the
    client cannot resend."""

    status = 503
    error_type = "server_error"


# --- the control plane (router/control.py) ---------------------------------------------------


class ControlError(RouterError):
    """Base class of the errors the control plane raises on purpose."""


class UpdateNotFound(ControlError):
    """No open weight update has that id (never begun, committed, or replaced by a newer
    begin)."""

    status = 404
    error_type = "not_found_error"


class ControlConflict(ControlError):
    """The call does not fit the control plane's state (e.g. resume during a half-loaded
    update)."""

    status = 409
    error_type = "invalid_request_error"


class ReplicasFailed(ControlError):
    """No engine replica could carry out the call (none is ready, or each one failed)."""

    status = 503
    error_type = "server_error"


class ReplicasBusy(RouterError):
    """Every engine replica's queue is full (or the routing key's replica's is): retry later."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"  # OpenAI's


class ReplicaFailed(RouterError):
    """No engine replica can serve, or the one serving the request failed mid-request (a
    clean 503, never a hang); sending it again may well succeed."""

    status = 503
    error_type = "server_error"


ROUTER_DOWN = "the Router actor is unavailable (restarting?); retry"

# what the far side of a Ray call raises on purpose, which arrives as itself: the Router's
# errors, bad input, and the engine's RuntimeErrors (EnginePaused, RequestFailed,
# WeightTransferFailed, ChannelClosed, "pause the engine before updating its weights", ...)
PASSED_THROUGH = (RouterError, ValueError, RuntimeError)


def unwrapped(error: Exception) -> Exception:
    """What the actor raised on purpose (`PASSED_THROUGH`), as itself: Ray wraps it in a
    `RayTaskError` whose `cause` it is. Other errors as they are."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, PASSED_THROUGH) else error


async def call_router(ref: Any, down: Callable[[str], Exception] = ReplicaFailed) -> Any:
    """A Router actor call's result. What the Router (or a replica through it) raised on
    purpose arrives as itself (`unwrapped`). A Router that died or restarts is
    `down(ROUTER_DOWN)`: `ReplicaFailed` (503) by default."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return await ref
    except RayTaskError as e:
        cause = unwrapped(e)
        if cause is e:
            raise
        raise cause from None
    except RayActorError as e:
        raise down(ROUTER_DOWN) from e
