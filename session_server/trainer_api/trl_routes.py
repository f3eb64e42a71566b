"""The routes of TRL's former `trl vllm-serve` server (TRL up to 0.2x; `GRPOTrainer(vllm_mode=
"server")` with those versions), with their trailing slashes. TRL's current `VLLMClient` speaks
vLLM's own API instead (`vllm_routes` and the OpenAI routes)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from raylane.session_server.context import backend_of
from raylane.session_server.errors import APIError
from raylane.session_server.openapi import ok
from raylane.session_server.response_schemas import _Out
from raylane.session_server.trainer_api.common import control_of, info_of, world_size
from raylane.session_server.trainer_api.schemas import WorldSize

router = APIRouter(tags=["TRL vllm-serve"])
control = APIRouter(tags=["TRL vllm-serve"])


class Health(_Out):
    status: str


class TensorParallelSize(_Out):
    tensor_parallel_size: int


class Done(_Out):
    message: str


@router.get("/health/", response_model=None, responses=ok(Health))
async def health(request: Request) -> dict:
    if not await backend_of(request).ready():
        raise APIError(503, "no engine replica is ready", code="not_ready")
    return {"status": "ok"}


@router.get("/get_world_size/", response_model=None, responses=ok(WorldSize))
async def get_world_size(request: Request) -> dict:
    return {"world_size": world_size(info_of(request))}


@router.get("/get_tensor_parallel_size/", response_model=None, responses=ok(TensorParallelSize))
async def get_tensor_parallel_size(request: Request) -> dict:
    return {"tensor_parallel_size": info_of(request).tensor_parallel_size}


@control.post("/reset_prefix_cache/", response_model=None, responses=ok(Done))
async def reset_prefix_cache(request: Request) -> dict:
    await control_of(request).flush_cache()
    return {"message": "Request received, resetting prefix cache status: True"}
