"""The routes SkyRL's `RemoteInferenceClient` calls beyond vLLM's own (SkyRL's vLLM server
adds them): `POST /skyrl/v1/generate`, tokens in and out with the routed experts as a nested
list over the whole sequence, and `POST /collective_rpc` with the three methods of SkyRL's
broadcast weight sync (`skyrl_start_weight_update`, `update_weights_nccl`,
`skyrl_finish_weight_update`), which are vLLM's `start_weight_update`, `update_weights` and
`finish_weight_update` here: the same one transaction."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError
from raylane.session_server.context import new_id
from raylane.session_server.errors import bad_request
from raylane.session_server.openapi import ok
from raylane.session_server.response_schemas import _Out
from raylane.session_server.streaming import final_outputs
from raylane.session_server.trainer_api.schemas import TokensRequest
from raylane.session_server.trainer_api.vllm_generate import start_tokens
from raylane.session_server.trainer_api.vllm_weights import (
    StartBody,
    UpdateBody,
    finish_weight_update,
    start_weight_update,
    update_weights,
)

router = APIRouter(tags=["SkyRL"])
control = APIRouter(tags=["SkyRL"])


class SkyRLChoice(_Out):
    token_ids: list[int]
    finish_reason: str
    logprobs: dict[str, list[dict[str, float]]] | None  # {"content": [{"logprob"}]}
    routed_experts: list[list[list[int]]] | None  # [prompt + output - 1, layers, top_k]


class SkyRLGenerated(_Out):
    choices: list[SkyRLChoice]


class RpcBody(BaseModel):
    method: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    args: list[Any] = Field(default_factory=list)
    timeout: float | None = None


class RpcResults(_Out):
    results: list[Any]


@router.post("/skyrl/v1/generate", response_model=None, responses=ok(SkyRLGenerated))
async def skyrl_generate(body: TokensRequest, request: Request) -> dict:
    params, stream = await start_tokens(body, request, body.request_id or new_id("skyrl"))
    c = (await final_outputs(request, stream, 1))[0].outputs[0]
    logprobs = None
    if params.logprobs is not None:
        logprobs = {"content": [{"logprob": lp} for lp in c.logprobs or []]}
    experts = c.routed_experts
    return {
        "choices": [
            {
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason or "stop",
                "logprobs": logprobs,
                "routed_experts": None if experts is None else experts.tolist(),
            }
        ]
    }


@control.post("/collective_rpc", response_model=None, responses=ok(RpcResults))
async def collective_rpc(body: RpcBody, request: Request) -> dict:
    try:
        if body.method == "skyrl_start_weight_update":
            start = StartBody(**body.kwargs)
            await start_weight_update(request, start)
        elif body.method == "update_weights_nccl":
            update = UpdateBody(**body.kwargs)  # {update_info: vLLM's}
            await update_weights(update, request)
        elif body.method == "skyrl_finish_weight_update":
            await finish_weight_update(request, None)
        else:
            raise bad_request(f"method: {body.method!r} is not one raylane serves", "method")
    except ValidationError as e:
        raise bad_request(f"kwargs: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}", "kwargs")
    return {"results": [None]}
