"""The weight-sync routes of TRL's former `trl vllm-serve` server (TRL up to 0.29's
`VLLMClient.init_communicator`, `update_named_param`, `update_model_params`,
`close_communicator`), over the control plane's one transaction.

TRL's scheme: the trainer is the last rank of a group of every inference rank and itself;
inference rank 0 hosts the group's store (TRL sends host "0.0.0.0"; its trainer connects to
the host it reached the server at). Each `/update_named_param/` announces one tensor and
returns; then the trainer broadcasts it and waits in a barrier. TRL's server answers at once
and works in the background; here each call answers once every rank has checked it (a name,
shape or dtype that does not fit is a 400 and drops the whole update), and the join or the
receive goes on in the background; if that fails, the next call says so.

The transaction: the first `/update_named_param/` opens an update (pausing in mode "keep"),
each later one loads into it, and `/reset_prefix_cache/`, which TRL's trainers call after the
last tensor, commits it on every replica at once (the next version) before it flushes;
`/close_communicator/` commits one still open and leaves the group.

TRL's client builds its side with vLLM's NCCL helper (CUDA only); raylane serves the scheme
over gloo (CPU engines): a trainer builds its side with torch's own process-group helper, as
SGLang's do, at rank world_size - 1.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from raylane.actors.runner.group_info import DEFAULT_GROUP_NAME
from raylane.session_server.openapi import ok
from raylane.session_server.trainer_api.common import (
    commit_open_update,
    control_of,
    into_open_update,
)
from raylane.session_server.trainer_api.vllm_weights import Done, specs

router = APIRouter(tags=["TRL vllm-serve"])
control = APIRouter(tags=["TRL vllm-serve"])

WILDCARDS = ("", "0.0.0.0", "::")  # a bind address: the trainer connects to the server's host


class InitCommunicatorBody(BaseModel):
    host: str
    port: int
    world_size: int  # the inference ranks and the trainer
    client_device_uuid: str | None = None  # TRL's check that the trainer's GPU is not ours


class NamedParamBody(BaseModel):
    name: str
    dtype: str  # "torch.float32"
    shape: list[int]


class BatchNamedParamsBody(BaseModel):
    updates: list[NamedParamBody] = Field(min_length=1)


class BatchDone(Done):
    successful: list[str]  # every name: a batch is taken whole or refused (400)


@control.post("/init_communicator/", response_model=None, responses=ok(Done))
async def init_communicator(body: InitCommunicatorBody, request: Request) -> dict:
    host = (request.url.hostname or "") if body.host in WILDCARDS else body.host
    info = {
        "master_address": host,
        "master_port": body.port,
        "rank_offset": 0,
        "world_size": body.world_size,
        "group_name": DEFAULT_GROUP_NAME,
        "trainer_last": True,
    }
    await control_of(request).init_weight_group(info, True)  # detached
    return {"message": "Request received, initializing communicator"}


@control.post("/update_named_param/", response_model=None, responses=ok(Done))
async def update_named_param(body: NamedParamBody, request: Request) -> dict:
    await _announce(request, [body])
    return {"message": "Request received, updating named parameter"}


@control.post("/batch_update_named_params/", response_model=None, responses=ok(BatchDone))
async def batch_update_named_params(body: BatchNamedParamsBody, request: Request) -> dict:
    await _announce(request, body.updates)
    names = [u.name for u in body.updates]
    return {"message": f"Successfully updated {len(names)} parameters", "successful": names}


async def _announce(request: Request, params: list[NamedParamBody]) -> None:
    """Check `params` on every rank, then receive their broadcasts (in the background) into
    the open update, or a new one; a refusal drops the whole update."""
    ctl = control_of(request)
    tensors = specs([p.name for p in params], [p.dtype for p in params], [p.shape for p in params])
    try:
        if not await into_open_update(ctl, DEFAULT_GROUP_NAME, tensors, detach=True):
            await ctl.begin_update(None, None)  # the first tensor of an update
            await ctl.receive_weights(None, DEFAULT_GROUP_NAME, tensors, None, True)
    except BaseException:
        await ctl.abort_update()  # nothing of it stays, earlier tensors included
        raise


@control.post("/close_communicator/", response_model=None, responses=ok(Done))
async def close_communicator(request: Request) -> dict:
    ctl = control_of(request)
    await commit_open_update(ctl)
    await ctl.destroy_weight_group(DEFAULT_GROUP_NAME)
    return {"message": "Request received, closing communicator"}
