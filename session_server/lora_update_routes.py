"""The adapter-only update over HTTP, beside the weight update's admin routes (only with an admin
key): open it with the adapter's tensor manifest (PEFT's names), send its safetensors buckets,
commit; one transaction across every replica (router/lora_control.py).

  POST /admin/update_lora/begin {lora_name, tensors: [{name, shape, dtype}]} -> {update_id}
  POST /admin/update_lora/{update_id}/bucket  (safetensors bytes)         -> {tensors}
  POST /admin/update_lora/{update_id}/commit  {version?}                  -> {lora_name, version}
  POST /admin/update_lora/{update_id}/abort                               -> {aborted: true}

Over the trainer's collective group (gloo; the trainer is rank 0, each replica one rank) instead
of buckets: `init_group {init_info}` once (while the trainer joins), then per update `begin`,
`{update_id}/receive {group_name}` while the trainer broadcasts the manifest's tensors in order,
`commit` (router/lora_groups.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from raylane.actors.runner.group_info import DEFAULT_GROUP_NAME
from raylane.session_server.admin_routes import control_of
from raylane.session_server.errors import bad_request
from raylane.session_server.openapi import BINARY

BUCKET_PATH = r"/admin/update_lora/[^/]+/bucket"  # for the body limit

router = APIRouter(prefix="/admin/update_lora")


class BeginLoRAUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    tensors: list[dict[str, Any]] = Field(min_length=1)  # {"name", "shape", "dtype"} each


class CommitLoRAUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: StrictInt | StrictStr | None = None  # the new version's label (None: the next)


@router.post("/begin", response_model=None)
async def begin(body: BeginLoRAUpdate, request: Request) -> dict:
    update_id = await control_of(request).begin_lora_update(body.lora_name, body.tensors)
    return {"update_id": update_id}


@router.post(
    "/{update_id}/bucket",
    response_model=None,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/octet-stream": BINARY}}
    },
)
async def bucket(update_id: str, request: Request) -> dict:
    """Body: the bucket's safetensors bytes (Content-Type application/octet-stream)."""
    payload = await request.body()
    if not payload:
        raise bad_request("the body must hold the bucket's safetensors bytes")
    return {"tensors": await control_of(request).load_lora_bucket(update_id, payload)}


class InitLoRAGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict[str, Any]  # GroupInfo's fields


class ReceiveLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = DEFAULT_GROUP_NAME


@router.post("/init_group", response_model=None)
async def init_group(body: InitLoRAGroup, request: Request) -> dict:
    return await control_of(request).init_lora_group(body.init_info)


@router.post("/{update_id}/receive", response_model=None)
async def receive(update_id: str, body: ReceiveLoRA, request: Request) -> dict:
    return {"tensors": await control_of(request).receive_lora(update_id, body.group_name)}


@router.post("/{update_id}/commit", response_model=None)
async def commit(update_id: str, request: Request, body: CommitLoRAUpdate | None = None) -> dict:
    version = None if body is None else body.version
    return {"version": await control_of(request).commit_lora_update(update_id, version)}


@router.post("/{update_id}/abort", response_model=None)
async def abort(update_id: str, request: Request) -> dict:
    await control_of(request).abort_lora_update(update_id)
    return {"aborted": True}
