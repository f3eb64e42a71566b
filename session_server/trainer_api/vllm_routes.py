"""vLLM's RL API (its dev-mode routes), over raylane's control plane: pause and resume with
vLLM's modes, the pause state, the world size, the weight version, aborts and the prefix cache.
Errors are the OpenAI error body, as vLLM's own server answers them."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from raylane.session_server.errors import from_exception
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import (
    control_of,
    info_of,
    is_paused,
    labels_of,
    version_label,
    world_size,
)
from raylane.session_server.trainer_api.schemas import (
    Aborted,
    AbortRequestsBody,
    IsPaused,
    Status,
    UpdateWeightVersionBody,
    VersionUpdated,
    WeightVersionText,
    WorldSize,
)

router = APIRouter(tags=["vLLM RL API"])
control = APIRouter(tags=["vLLM RL API"])


@control.post("/pause", response_model=None, responses=ok(Status))
async def pause(
    request: Request,
    mode: Literal["abort", "wait", "keep"] = Query("abort"),
    wait_for_inflight_requests: bool = Query(False),  # vLLM's older spelling of mode=wait
    clear_cache: bool = Query(True),
) -> dict:
    """Pause generation. "abort" ends what runs (partial outputs, finish reason "abort"),
    "wait" lets it finish, "keep" freezes it with its KV until /resume. `clear_cache` drops
    the prefix cache afterwards (not with "keep", as vLLM)."""
    if wait_for_inflight_requests and mode == "abort":
        mode = "wait"
    ctl = control_of(request)
    await ctl.pause(mode)
    if clear_cache and mode != "keep":
        await ctl.flush_cache()
    return {"status": "paused"}


@control.post("/resume", response_model=None, responses=ok(Status))
async def resume(request: Request) -> dict:
    await control_of(request).resume()
    return {"status": "resumed"}


@router.get("/is_paused", response_model=None, responses=ok(IsPaused))
async def get_is_paused(request: Request) -> dict:
    return {"is_paused": await is_paused(control_of(request))}


@router.get("/get_world_size", response_model=None, responses=ok(WorldSize))
async def get_world_size(request: Request, include_dp: bool = Query(True)) -> dict:
    """Inference ranks: replicas x TP (`include_dp=false`: one replica's TP)."""
    return {"world_size": world_size(info_of(request), include_dp)}


@router.get("/weight_info", response_model=None, responses=ok(WeightVersionText))
async def weight_info(request: Request) -> dict:
    return {"weight_version": await labels_of(request).current()}


@control.post(
    "/reset_prefix_cache",
    response_class=Response,
    responses=ok(description="Flushed: an empty body"),
)
async def reset_prefix_cache(request: Request) -> Response:
    await control_of(request).flush_cache()
    return Response(status_code=200)


@control.post("/abort_requests", response_model=None, responses=ok(Aborted))
async def abort_requests(request: Request, body: AbortRequestsBody | None = None) -> dict:
    """End these requests (none or empty: every request) wherever they run."""
    ids = body.request_ids if body is not None and body.request_ids else None
    outputs = await control_of(request).abort(ids)
    return {"status": "aborted", "aborted": len({o.request_id for o in outputs})}


@control.post("/update_weight_version", response_model=None, responses=ok(VersionUpdated))
async def update_weight_version(body: UpdateWeightVersionBody, request: Request) -> dict:
    """vLLM's and SGLang's (the same path): the weights every replica holds are labelled
    `new_version` (any label), as one update with no tensors: raylane's integer version grows
    by one, so new prefills stop matching older prefix-cache chains. SGLang's
    `abort_all_requests` ends what runs first."""
    label = version_label(body.new_version, "new_version")
    ctl = control_of(request)
    if body.abort_all_requests:
        await ctl.abort(None)
    try:
        await ctl.set_weight_version(None, label)
    except ValueError as e:
        raise from_exception(e, {"label": "new_version"}) from None
    return {
        "success": True,
        "message": f"Weight version updated to {label}",
        "new_version": label,
    }
