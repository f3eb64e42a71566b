"""Loading and unloading LoRA adapters at runtime, in vLLM's and SGLang's shapes, over the one
control plane (every replica, all or none: router/lora_control.py). Served when adapters are
(`EngineConfig.enable_lora`); like the trainer protocols, `control` holds the routes that change
state, which the admin key guards when one is configured.

- vLLM: `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace?}` and
  `POST /v1/unload_lora_adapter {lora_name}`, answering plain text on success and vLLM's error
  body otherwise (400 already loaded / bad adapter, 404 unknown adapter).
- SGLang: `POST /load_lora_adapter {lora_name, lora_path, pinned?}` and
  `POST /unload_lora_adapter {lora_name}`, answering `{success, error_message,
  loaded_adapters}` (400 when not a success).
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from raylane.session_server.admin_routes import control_of
from raylane.session_server.errors import APIError, from_exception
from raylane.session_server.lora_errors import lora_http_error
from raylane.session_server.openapi import ERRORS

router = APIRouter()  # nothing to read beyond /v1/models
control = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):  # vLLM's
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):  # vLLM's
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


class SGLangLoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class SGLangUnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_id: str | None = None


def _vllm_error(error: BaseException, name: str) -> APIError:
    """vLLM's error for a failed load or unload (types BadRequestError / NotFoundError)."""
    lora = lora_http_error(error)
    if lora is not None and lora.status == 404:
        return APIError(
            404,
            f"The lora adapter '{name}' cannot be found.",
            param="lora_name",
            code=404,
            type="NotFoundError",
        )
    api = from_exception(error)
    kind = "BadRequestError" if api.status == 400 else api.type
    return APIError(api.status, api.message, param=api.param, code=api.status, type=kind)


@control.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def vllm_load(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    if not body.lora_name or not body.lora_path:
        raise APIError(
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
            code=400,
            type="BadRequestError",
        )
    try:
        await control_of(request).load_lora(
            body.lora_name, body.lora_path, False, body.load_inplace
        )
    except ValueError as e:
        raise _vllm_error(e, body.lora_name) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@control.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def vllm_unload(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    try:
        await control_of(request).unload_lora(body.lora_name)
    except ValueError as e:
        raise _vllm_error(e, body.lora_name) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _sglang_answer(request: Request, error: ValueError | None) -> JSONResponse:
    adapters = await control_of(request).list_loras()
    body = {
        "success": error is None,
        "error_message": None if error is None else str(error),
        "loaded_adapters": {a["name"]: a["path"] for a in adapters},
    }
    return JSONResponse(body, status_code=200 if error is None else 400)


@control.post("/load_lora_adapter")
async def sglang_load(body: SGLangLoadLoRARequest, request: Request) -> JSONResponse:
    try:
        await control_of(request).load_lora(body.lora_name, body.lora_path, body.pinned, False)
    except ValueError as e:
        return await _sglang_answer(request, e)
    return await _sglang_answer(request, None)


@control.post("/unload_lora_adapter")
async def sglang_unload(body: SGLangUnloadLoRARequest, request: Request) -> JSONResponse:
    try:
        await control_of(request).unload_lora(body.lora_name)
    except ValueError as e:
        return await _sglang_answer(request, e)
    return await _sglang_answer(request, None)


def mount(app: FastAPI) -> frozenset[str]:
    """Add the adapter routes to `app`; the paths of those that change state."""
    for routes in (router, control):
        app.include_router(routes, responses=ERRORS)
    return frozenset(route.path for route in control.routes)  # type: ignore[attr-defined]
