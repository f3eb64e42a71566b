"""The admin routes of the RL control plane, under /admin/ (only with an admin key; `AdminAuth`
checks it): pause, resume, the weight update transaction, the weight version, abort, and the
prefix cache.

Weight buckets travel as raw safetensors bytes (never pickle), one request per bucket, so the
server holds one bucket at a time; the body limit of that route alone is large (`build_app`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from raylane.session_server.backend import ControlBackend
from raylane.session_server.context import backend_of
from raylane.session_server.errors import bad_request
from raylane.session_server.native_format import partial_items
from raylane.session_server.openapi import BINARY, ok
from raylane.session_server.response_schemas import (
    Aborted,
    BucketLoaded,
    CacheFlushed,
    ControlState,
    UpdateBegun,
    WeightVersion,
)
from raylane.session_server.schemas import AbortRequest, BeginUpdateRequest, PauseRequest

BUCKET_PATH = r"/admin/update_weights/[^/]+/bucket"  # for the body limit

router = APIRouter(prefix="/admin")


def control_of(request: Request) -> ControlBackend:
    return backend_of(request).control


@router.post("/pause", response_model=None, responses=ok(ControlState))
async def pause(body: PauseRequest, request: Request) -> dict:
    return await control_of(request).pause(body.mode)


@router.post("/resume", response_model=None, responses=ok(ControlState))
async def resume(request: Request) -> dict:
    return await control_of(request).resume()


@router.post("/update_weights/begin", response_model=None, responses=ok(UpdateBegun))
async def begin_update(body: BeginUpdateRequest, request: Request) -> dict:
    update_id = await control_of(request).begin_update(body.version, body.tensors)
    return {"update_id": update_id}


@router.post(
    "/update_weights/{update_id}/bucket",
    response_model=None,
    responses=ok(BucketLoaded),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/octet-stream": BINARY}}
    },
)
async def load_bucket(update_id: str, request: Request) -> dict:
    """Body: the bucket's safetensors bytes (Content-Type application/octet-stream)."""
    payload = await request.body()
    if not payload:
        raise bad_request("the body must hold the bucket's safetensors bytes")
    return {"tensors": await control_of(request).load_bucket(update_id, payload)}


@router.post("/update_weights/{update_id}/commit", response_model=None, responses=ok(WeightVersion))
async def commit_update(update_id: str, request: Request) -> dict:
    return {"weight_version": await control_of(request).commit_update(update_id)}


@router.get("/weight_version", response_model=None, responses=ok(WeightVersion))
async def weight_version(request: Request) -> dict:
    """raylane's integer version, and the label a trainer protocol committed it with (vLLM's
    `finish_weight_update`, SGLang's `weight_version`) when one did."""
    state = await control_of(request).control_state()
    return {k: state[k] for k in ("weight_version", "weight_label") if k in state}


@router.post("/abort", response_model=None, responses=ok(Aborted))
async def abort(body: AbortRequest, request: Request) -> dict:
    return {"outputs": partial_items(await control_of(request).abort(body.request_ids))}


@router.post("/flush_cache", response_model=None, responses=ok(CacheFlushed))
async def flush_cache(request: Request) -> dict:
    await control_of(request).flush_cache()
    return {"flushed": True}
