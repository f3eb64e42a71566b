"""SGLang's native API, over raylane's control plane: server info, health by generation, aborts,
loads, pause and continue with SGLang's modes, the radix (prefix) cache and the weight version.
/generate is raylane's own route, which answers SGLang's exact shape while these are mounted
(`native_format`). Errors are `{"error": {"message", ...}}`, as SGLang's (with OpenAI's keys)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import time

from fastapi import APIRouter, Request, Response
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server.context import backend_of, new_id
from raylane.session_server.errors import APIError
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import (
    commit_open_update,
    control_of,
    info_of,
    labels_of,
)
from raylane.session_server.trainer_api.schemas import (
    AbortRequestBody,
    Loads,
    Message,
    ModelInfoAnswer,
    PauseGenerationBody,
    ServerInfo,
    WeightVersionText,
)

router = APIRouter(tags=["SGLang native API"])
control = APIRouter(tags=["SGLang native API"])

# SGLang's pause modes as raylane's: "in_place" keeps requests with their KV
PAUSE_MODES = {"abort": "abort", "retract": "retract", "in_place": "keep"}
TEXT = {"text/plain": {"schema": {"type": "string"}}}
VERSION = importlib.metadata.version("raylane")


@router.get("/server_info", response_model=None, responses=ok(ServerInfo))
@router.get("/get_server_info", response_model=None, responses=ok(ServerInfo))
async def server_info(request: Request) -> dict:
    """SGLang's server arguments (the keys trainers compare with their own), and vLLM's
    `vllm_config` for vLLM's clients, which ask the same path."""
    info = info_of(request)
    version = await labels_of(request).current()
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "served_model_name": info.name,
        "tp_size": info.tensor_parallel_size,
        "dp_size": info.replicas,
        "pp_size": 1,
        "ep_size": 1,
        "dtype": info.dtype,
        "context_length": info.max_model_len,
        "enable_return_routed_experts": info.routed_experts,
        # SGLang's name for its batch-invariant mode, and raylane's
        "enable_deterministic_inference": info.batch_invariant,
        "batch_invariant": info.batch_invariant,
        "weight_version": version,
        "version": VERSION,
        "vllm_config": {
            "model_config": {"model": info.model_path, "dtype": info.dtype},
            "parallel_config": {
                "tensor_parallel_size": info.tensor_parallel_size,
                "data_parallel_size": info.replicas,
                "pipeline_parallel_size": 1,
            },
            # None unless adapters are served (TRL's AsyncGRPO probes it to sync adapters only)
            "lora_config": (
                {"max_loras": info.max_loras, "max_lora_rank": info.max_lora_rank}
                if info.enable_lora
                else None
            ),
        },
    }


@router.get("/model_info", response_model=None, responses=ok(ModelInfoAnswer))
@router.get("/get_model_info", response_model=None, responses=ok(ModelInfoAnswer))
async def model_info(request: Request) -> dict:
    """SGLang's model info (its frontend's `RuntimeEndpoint` asks it first)."""
    info = info_of(request)
    return {
        "model_path": info.model_path,
        "served_model_name": info.name,
        "tokenizer_path": info.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": await labels_of(request).current(),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@router.get("/get_weight_version", response_model=None, responses=ok(WeightVersionText))
async def get_weight_version(request: Request) -> dict:
    return {"weight_version": await labels_of(request).current()}


@router.get(
    "/health_generate",
    response_class=Response,
    responses=ok(description="One token was generated: an empty body (503 if it failed)"),
)
async def health_generate(request: Request) -> Response:
    """Healthy when a replica generates one token (SGLang's deeper check than /health)."""
    backend = backend_of(request)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        deltas = backend.generate([0], params, new_id("health"))
        async with contextlib.aclosing(deltas) as it:
            async for _ in it:
                pass
    except Exception as e:  # noqa: BLE001 - any failure to generate means not healthy
        raise APIError(503, f"generation failed: {type(e).__name__}", code="not_ready") from e
    return Response(status_code=200)


@router.get("/v1/loads", response_model=None, responses=ok(Loads))
async def loads(request: Request) -> dict:
    """The load of every live replica (SGLang's DP ranks)."""
    stats = await backend_of(request).stats()
    gauges = [s.get("gauges", {}) for s in stats]
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dp_rank_count": len(gauges),
        "loads": [
            {
                "dp_rank": rank,
                "num_running_reqs": int(g.get("num_requests_running", 0)),
                "num_waiting_reqs": int(g.get("num_requests_waiting", 0)),
                "token_usage": float(g.get("kv_cache_usage_perc", 0.0)),
            }
            for rank, g in enumerate(gauges)
        ],
    }


@control.post("/pause_generation", response_model=None, responses=ok(Message))
async def pause_generation(request: Request, body: PauseGenerationBody | None = None) -> dict:
    """ "abort" ends what runs, "retract" frees its KV (it re-prefills after /continue_generation),
    "in_place" keeps it with its KV."""
    mode = body.mode if body is not None else "abort"
    await control_of(request).pause(PAUSE_MODES[mode])
    return {"message": "Generation paused successfully.", "status": "ok"}


@control.post("/continue_generation", response_model=None, responses=ok(Message))
async def continue_generation(request: Request) -> dict:
    """Commits the update the pause's `update_weights_from_distributed` buckets loaded, if any
    (sglang_weights.py), then resumes."""
    ctl = control_of(request)
    await commit_open_update(ctl)
    await ctl.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@control.get(
    "/flush_cache",
    response_class=Response,
    responses=ok(description="Flushed", content=TEXT),
    operation_id="flush_cache_get",
)
@control.post(
    "/flush_cache",
    response_class=Response,
    responses=ok(description="Flushed", content=TEXT),
    operation_id="flush_cache_post",
)
async def flush_cache(request: Request) -> Response:
    await control_of(request).flush_cache()
    return Response("Cache flushed.\n", media_type="text/plain")


@control.post(
    "/abort_request",
    response_class=Response,
    responses=ok(description="Aborted (unknown ids are skipped): an empty body"),
)
async def abort_request(body: AbortRequestBody, request: Request) -> Response:
    """End the request `rid`, or every request (`abort_all`)."""
    if not body.abort_all and not body.rid:
        raise APIError(400, "give rid, or abort_all: true", param="rid", code="invalid_value")
    await control_of(request).abort(None if body.abort_all else [body.rid])
    return Response(status_code=200)
