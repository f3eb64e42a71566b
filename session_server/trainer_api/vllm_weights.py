"""vLLM's collective weight-transfer routes, over the control plane's one transaction:
`init_weight_transfer_engine` joins every rank to the trainer's group, `start_weight_update`
opens an update (its tensors come with each `update_weights`, checked on every rank before a
byte moves), `update_weights` receives one broadcast batch (vLLM's `packed` chunking too), and
`finish_weight_update` switches every replica to the new version at once, under the label
`weight_version` if one is given ("step-42": raylane's own integer version still grows by one).
A refused finish commits nothing and leaves the update open (generation stays paused): its error
says so, and to send the finish again or drop the update (`abort_weight_update`, raylane's).

`init_info.backend` may be "gloo" (SGLang's group scheme, for CPU engines); the default is
vLLM's "nccl".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import (
    Label,
    control_of,
    hinted_route,
    version_label,
)

router = APIRouter(tags=["vLLM RL API"])
control = APIRouter(tags=["vLLM RL API"])

PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


class InitInfo(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "nccl"
    group_name: str = "weight_update_group"


class InitBody(BaseModel):
    init_info: InitInfo


class StartBody(BaseModel):
    is_checkpoint_format: bool = True


class UpdateInfo(BaseModel):
    model_config = ConfigDict(extra="allow")  # other backends' fields (ipc handles) are refused

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = PACKED_BUFFER_BYTES
    packed_num_buffers: int = 2  # the trainer's double buffering; one stream here


class UpdateBody(BaseModel):
    update_info: UpdateInfo


class FinishBody(BaseModel):
    weight_version: Label | None = None  # a label: "step-42", "7", 42


# what a refused finish leaves behind, and the two ways on
STILL_OPEN = (
    "Nothing was committed: the open weight update, if any, stays open and generation "
    "stays paused. "
    "Send POST /finish_weight_update again with a valid body, or drop the update with "
    "POST /abort_weight_update"
)


class Done(BaseModel):
    message: str


@control.post("/init_weight_transfer_engine", response_model=None, responses=ok(Done))
async def init_weight_transfer_engine(body: InitBody, request: Request) -> dict[str, Any]:
    await control_of(request).init_weight_group(body.init_info.model_dump())
    return {"message": "Weight transfer engine initialized"}


@control.post("/start_weight_update", response_model=None, responses=ok(Done))
async def start_weight_update(request: Request, body: StartBody | None = None) -> dict:
    if body is not None and not body.is_checkpoint_format:
        raise ValueError("is_checkpoint_format: raylane takes Hugging Face checkpoint names only")
    await control_of(request).begin_update(None, None)
    return {"message": "Weight update started"}


@control.post("/update_weights", response_model=None, responses=ok(Done))
async def update_weights(body: UpdateBody, request: Request) -> dict:
    info = body.update_info
    packing = {"packed": info.packed, "buffer_bytes": info.packed_buffer_size_bytes}
    await control_of(request).receive_weights(
        None, "weight_update_group", specs(info.names, info.dtype_names, info.shapes), packing
    )
    return {"message": "Weights updated"}


async def finish_weight_update(request: Request, body: FinishBody | None = None) -> dict:
    given = body.weight_version if body is not None else None
    label = None if given is None else version_label(given, "weight_version")
    await control_of(request).commit_update(None, None, label)
    return {"message": "Weight update finished"}


control.add_api_route(
    "/finish_weight_update",
    finish_weight_update,
    methods=["POST"],
    response_model=None,
    responses=ok(Done),
    route_class_override=hinted_route(STILL_OPEN),
)


@control.post("/abort_weight_update", response_model=None, responses=ok(Done))
async def abort_weight_update(request: Request) -> dict:
    """raylane's: drop the open weight update, if any. Every replica puts back the weights it
    received and keeps its version; the cluster resumes if the update paused it (not if the
    trainer did: its /resume then succeeds)."""
    await control_of(request).abort_update(None)
    return {"message": "Weight update aborted"}


def specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[dict]:
    """A peer's parallel lists as the control plane's tensor specs (400 if they disagree)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes: {len(names)}, {len(dtypes)} and {len(shapes)} entries"
        )
    return [
        {"name": n, "shape": list(s), "dtype": str(d).removeprefix("torch.")}
        for n, d, s in zip(names, dtypes, shapes)
    ]
