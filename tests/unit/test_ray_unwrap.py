"""One unwrapper for what crosses a Ray call (`raylane.router.errors.call_router`/`unwrapped`):
what the far side raised on purpose arrives as itself (its class and fields kept), anything
else as Ray's wrapper, and a dead actor as the caller's own error. Ray's real exception
classes, built as Ray builds them, without a cluster."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from raylane.actors.engine.errors import EnginePaused, WeightTransferFailed
from raylane.client.errors import NoReplica
from raylane.router.errors import (
    ROUTER_DOWN,
    ReplicaFailed,
    SessionNotFound,
    call_router,
    unwrapped,
)


class AdapterMissing(ValueError):
    """A subclass of ValueError the caller tells apart (as the LoRA errors are)."""


def wrapped(cause: BaseException) -> Exception:
    return RayTaskError("remote_call", "Traceback: ...", cause).as_instanceof_cause()


async def raising(error: BaseException) -> None:
    raise error


@pytest.mark.parametrize(
    "cause",
    [
        SessionNotFound("s-1"),
        AdapterMissing("lora: 'x' is not loaded"),
        EnginePaused("paused, queue full"),
        WeightTransferFailed("rolled back"),
        RuntimeError("pause the engine before updating its weights"),
    ],
)
async def test_what_was_raised_on_purpose_arrives_as_itself(cause):
    assert unwrapped(wrapped(cause)) is cause
    with pytest.raises(type(cause)) as got:
        await call_router(raising(wrapped(cause)))
    assert got.value is cause and not isinstance(got.value, RayTaskError)
    if isinstance(cause, SessionNotFound):
        assert got.value.status == 404 and got.value.session_id == "s-1"


async def test_other_errors_stay_rays_and_a_dead_actor_is_the_callers_error():
    other = wrapped(KeyError("bug"))
    assert unwrapped(other) is other
    with pytest.raises(RayTaskError):
        await call_router(raising(other))
    plain = OSError("no cause")
    assert unwrapped(plain) is plain
    with pytest.raises(ReplicaFailed, match="unavailable"):
        await call_router(raising(ActorDiedError()))
    with pytest.raises(NoReplica) as got:
        await call_router(raising(ActorDiedError()), down=NoReplica)
    assert str(got.value) == ROUTER_DOWN
