"""SGLang's collective weight-transfer routes, over the control plane's one transaction.

`update_weights_from_distributed` receives one broadcast per tensor, in order (checked on every
rank first). Where it lands depends on whether the trainer paused the cluster:
- paused (`/pause_generation`, as slime does before it sends its buckets, each with the same
  `weight_version`): every call of the pause loads into one open update, begun by the first at
  its `weight_version`, and `/continue_generation` commits it on every replica at once. A call
  that fails rolls the whole update back: the cluster stays on its old weights and version.
- not paused: the call is a whole update of its own (raylane pauses, "keep", around it).
`weight_version` is a label ("7", "step-42"): raylane's own integer version grows by one with
every commit whatever it says, and the label is what SGLang's routes answer for it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import (
    Label,
    control_of,
    into_open_update,
    is_paused,
    version_label,
)
from raylane.session_server.trainer_api.vllm_weights import specs

router = APIRouter(tags=["SGLang native API"])
control = APIRouter(tags=["SGLang native API"])


class InitGroupBody(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateBody(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Label | None = None


class DestroyBody(BaseModel):
    group_name: str = "weight_update_group"


class Succeeded(BaseModel):
    success: bool
    message: str


@control.post("/init_weights_update_group", response_model=None, responses=ok(Succeeded))
async def init_weights_update_group(body: InitGroupBody, request: Request) -> dict:
    await control_of(request).init_weight_group(body.model_dump())
    return {"success": True, "message": "Succeeded to initialize custom process group."}


@control.post("/update_weights_from_distributed", response_model=None, responses=ok(Succeeded))
async def update_weights_from_distributed(body: UpdateBody, request: Request) -> dict:
    ctl = control_of(request)
    given = body.weight_version
    label = None if given is None else version_label(given, "weight_version")
    tensors = specs(body.names, body.dtypes, body.shapes)
    held = await is_paused(ctl)  # by the trainer: its buckets are one update
    try:
        if not (held and await into_open_update(ctl, body.group_name, tensors)):
            await ctl.begin_update(None, None, label)
            await ctl.receive_weights(None, body.group_name, tensors)
        if not held:  # else /continue_generation commits
            await ctl.commit_update(None)  # the version key roots new prefix-cache chains
    except BaseException:
        await ctl.abort_update()  # nothing of a failed update stays, earlier buckets included
        raise
    return {"success": True, "message": "Succeeded to update parameter online."}


@control.post("/destroy_weights_update_group", response_model=None, responses=ok(Succeeded))
async def destroy_weights_update_group(request: Request, body: DestroyBody | None = None) -> dict:
    await control_of(request).destroy_weight_group(body.group_name if body else None)
    return {"success": True, "message": "Succeeded to destroy custom process group."}
