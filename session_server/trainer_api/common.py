"""What the trainer protocols share: the control plane of the request's backend, the serving
layout, and weight versions as the peers spell them (labels; raylane's are integers)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import StrictInt, StrictStr
from raylane.actors.engine.sampling_params import DATA_FIELDS
from raylane.router.errors import UpdateNotFound
from raylane.session_server.admin_routes import control_of
from raylane.session_server.backend import ControlBackend, ModelInfo
from raylane.session_server.context import backend_of
from raylane.session_server.errors import APIError, bad_request, describe_validation
from raylane.session_server.weight_labels import WeightLabels, labels_of_app

__all__ = [
    "control_of",
    "info_of",
    "world_size",
    "Label",
    "labels_of",
    "version_label",
    "hinted_route",
    "is_paused",
    "into_open_update",
    "commit_open_update",
]

# what a peer's sampling fields may set directly (vLLM's names are raylane's)
SAMPLING_FIELDS = frozenset(DATA_FIELDS)


def info_of(request: Request) -> ModelInfo:
    return backend_of(request).info


def world_size(info: ModelInfo, include_replicas: bool = True) -> int:
    """The inference ranks a trainer counts: replicas x TP (vLLM's DP x TP), or one replica's."""
    return info.tensor_parallel_size * (info.replicas if include_replicas else 1)


# a peer's weight version: a label ("step-42", "7", 42), never ordered or compared
Label = StrictStr | StrictInt
LABEL_CHARS = 256  # a label is echoed in every answer: a name, not a payload


def version_label(value: str | int, field: str) -> str:
    """A peer's weight version as the label raylane keeps beside its own integer, which
    every commit increments whatever the label says (400 naming `field` if too long)."""
    label = str(value)
    if len(label) > LABEL_CHARS:
        raise bad_request(f"{field}: a label of at most {LABEL_CHARS} characters", field)
    return label


def labels_of(request: Request) -> WeightLabels:
    """This ingress's texts of weight versions."""
    return labels_of_app(request.app)


def hinted_route(hint: str) -> type[APIRoute]:
    """A route class whose 400s (the body's validation too) end with `hint`: what the client
    should do next, where a refused call leaves state behind (an open weight update)."""

    class Hinted(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Any]]:
            handler = super().get_route_handler()

            async def hinted(request: Request) -> Any:
                try:
                    return await handler(request)
                except RequestValidationError as e:
                    message, param = describe_validation(e.errors())
                    raise bad_request(f"{message}. {hint}", param) from None
                except (APIError, ValueError) as e:
                    raise _with_hint(e, hint) from None

            return hinted

    return Hinted


def _with_hint(error: APIError | ValueError, hint: str) -> APIError | ValueError:
    if isinstance(error, ValueError):
        return ValueError(f"{error}. {hint}")
    if error.status != 400:
        return error
    return APIError(400, f"{error.message}. {hint}", param=error.param, code=error.code)


async def is_paused(control: ControlBackend) -> bool:
    return bool((await control.control_state())["paused"])


async def into_open_update(
    control: ControlBackend, group_name: str, tensors: list[dict], detach: bool = False
) -> bool:
    """Receive the trainer's broadcast of `tensors` into the open update; False if none is."""
    try:
        await control.receive_weights(None, group_name, tensors, None, detach)
    except UpdateNotFound:
        return False
    return True


async def commit_open_update(control: ControlBackend) -> int | None:
    """Commit the open update on every replica (the next version); None if none is open."""
    try:
        return await control.commit_update(None)
    except UpdateNotFound:
        return None
