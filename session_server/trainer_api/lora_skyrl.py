"""SkyRL's adapter route (its vLLM server adds it): `POST /skyrl/v1/load_lora_adapter {lora_name,
lora_path}` loads an adapter, or loads it again in place as its next version (SkyRL writes the
trainer's adapter to disk and reloads it each step), on every replica at once; SkyRL then
names the adapter as `model` per request (its tenants) and unloads it with vLLM's
`/v1/unload_lora_adapter` (session_server/lora_routes.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from raylane.actors.replica_lora import adapter_id
from raylane.session_server.errors import bad_request
from raylane.session_server.trainer_api.common import control_of

router = APIRouter(tags=["SkyRL"])
control = APIRouter(tags=["SkyRL"])


class LoadBody(BaseModel):
    lora_name: str | None = None
    lora_path: str | None = None


@control.post("/skyrl/v1/load_lora_adapter", response_model=None)
async def load_lora_adapter(body: LoadBody, request: Request) -> dict:
    if not body.lora_name or not body.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    await control_of(request).load_lora(body.lora_name, body.lora_path, False, True)
    return {"status": "ok", "lora_name": body.lora_name, "lora_int_id": adapter_id(body.lora_name)}
