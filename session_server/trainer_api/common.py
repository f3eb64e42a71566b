"""What the trainer protocols share: the control plane of the request's backend, the serving
layout, and weight versions as the peers spell them (strings; raylane's are integers)."""

from __future__ import annotations

import dataclasses

from fastapi import Request
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import UpdateNotFound
from raylane.session_server.admin_routes import control_of
from raylane.session_server.backend import ControlBackend, ModelInfo
from raylane.session_server.context import backend_of
from raylane.session_server.errors import bad_request

__all__ = [
    "control_of",
    "info_of",
    "world_size",
    "version_text",
    "version_number",
    "is_paused",
    "into_open_update",
    "commit_open_update",
]

# what a peer's sampling fields may set directly (vLLM's names are raylane's)
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def info_of(request: Request) -> ModelInfo:
    return backend_of(request).info


def world_size(info: ModelInfo, include_replicas: bool = True) -> int:
    """The inference ranks a trainer counts: replicas x TP (vLLM's DP x TP), or one replica's."""
    return info.tensor_parallel_size * (info.replicas if include_replicas else 1)


def version_text(version: int) -> str:
    """vLLM and SGLang carry weight versions as strings; raylane's integer, as one."""
    return str(version)


def version_number(value: str | int | None, field: str) -> int:
    """A peer's version string as raylane's integer version (400 naming `field` if it is not
    one: raylane orders versions, so a label like "step-7" cannot be compared)."""
    text = str(value).strip() if value is not None else ""
    if isinstance(value, bool) or not text.lstrip("-").isdigit():
        raise bad_request(
            f"{field}: raylane's weight versions are integers (a newer one is larger); "
            f"got {value!r}",
            field,
        )
    return int(text)


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
