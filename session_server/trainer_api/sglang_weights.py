"""SGLang's collective weight-transfer routes, over the control plane's one transaction. Each
`update_weights_from_distributed` is a whole update: open, receive one broadcast per tensor in
order (checked on every rank first), commit at `weight_version` (or the next) on every
replica at once; on a cluster the trainer did not pause, raylane pauses ("keep") around it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import control_of, version_number
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
    weight_version: str | int | None = None


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
    version = (
        None
        if body.weight_version is None
        else version_number(body.weight_version, "weight_version")
    )
    await ctl.begin_update(version, None)
    try:
        tensors = specs(body.names, body.dtypes, body.shapes)
        await ctl.receive_weights(None, body.group_name, tensors)
        await ctl.commit_update(None)  # the version key roots new prefix-cache chains anyway
    except BaseException:
        await ctl.abort_update()  # one call, one transaction: nothing of it stays open
        raise
    return {"success": True, "message": "Succeeded to update parameter online."}


@control.post("/destroy_weights_update_group", response_model=None, responses=ok(Succeeded))
async def destroy_weights_update_group(request: Request, body: DestroyBody | None = None) -> dict:
    await control_of(request).destroy_weight_group(body.group_name if body else None)
    return {"success": True, "message": "Succeeded to destroy custom process group."}
