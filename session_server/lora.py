"""Adapters on the OpenAI surface, as vLLM serves them: `model: <adapter name>` runs the request
on that LoRA adapter, `/v1/models` lists each adapter with `parent` the base model's id and
`root` its path, and a model that is neither gets vLLM's 404 body. raylane's `lora_version`
(a body field; the openai client's `extra_body`) asks for one version of the adapter: no anchor
names adapter versions on a request, so it is a field of its own, not part of `model`.

The ingress is stateless: it keeps the adapter names it has seen (`AdapterNames`) and asks the
control plane again only for a name it does not know, so a request for a known adapter costs
nothing extra. A name unloaded meanwhile reaches the engine, whose `LoRANotFound` answers the
same 404 (session_server/lora_errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.replica_lora import versioned
from raylane.router.session_lora import SESSION_LORA_KEY
from raylane.session_server.backend import EngineBackend
from raylane.session_server.context import backend_of, check_model
from raylane.session_server.errors import APIError, bad_request
from raylane.session_server.lora_errors import unknown_model


class AdapterNames:
    """The adapter names this ingress has seen registered (refreshed on a miss)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    async def has(self, backend: EngineBackend, name: str) -> bool:
        if name not in self.names:
            self.names = {a["name"] for a in await backend.control.list_loras()}
        return name in self.names


def _names(request: Request) -> AdapterNames:
    state = request.app.state
    if not hasattr(state, "adapter_names"):
        state.adapter_names = AdapterNames()
    return state.adapter_names


async def model_adapter(
    request: Request, model: str | None, version: int | None = None
) -> str | None:
    """The adapter `model` names (None: the base model); a name that is neither is a 404 —
    vLLM's body when adapters are served, the server's own otherwise. `version` (raylane's
    `lora_version`): that version of the adapter, 409 once it is no longer held."""
    backend = backend_of(request)
    info = backend.info
    if not info.enable_lora or model is None or model == info.name:
        check_model(model, info)
        if version is not None:
            raise bad_request("lora_version: asks for an adapter's version; name an adapter", _V)
        return None
    if not await _names(request).has(backend, model):
        raise _not_found(model)
    return versioned(model, version)


_V = "lora_version"


def _not_found(name: str) -> APIError:
    e = unknown_model(name)
    return APIError(e.status, e.message, param=e.param, code=e.code, type=e.type)


async def sglang_adapter(
    request: Request,
    lora_path: str | list[str | None] | None,
    num_prompts: int,
    version: int | None = None,
) -> str | None:
    """SGLang's `lora_path` on /generate: an adapter's name, or one per prompt (all the same
    here: a batch runs on one adapter)."""
    if lora_path is None:
        if version is not None:
            raise bad_request("lora_version: asks for an adapter's version; give lora_path", _V)
        return None
    names = [lora_path] if isinstance(lora_path, str) else list(lora_path)
    if not isinstance(lora_path, str) and len(names) != num_prompts:
        raise bad_request(f"lora_path: {len(names)} entries for {num_prompts} prompts", "lora_path")
    if len(set(names)) != 1:
        raise bad_request("lora_path: one adapter for every prompt of a request", "lora_path")
    if names[0] is None:
        return await model_adapter(request, None, version)  # the base model
    if not backend_of(request).info.enable_lora:
        raise bad_request("lora_path: this server was started without --enable-lora", "lora_path")
    return await model_adapter(request, names[0], version)


async def check_session_adapter(request: Request, metadata: dict[str, Any] | None) -> None:
    """A session opened on an adapter (`metadata["lora"]`) names one this server serves."""
    name = (metadata or {}).get(SESSION_LORA_KEY)
    if name is None:
        return
    if not isinstance(name, str) or not name:
        raise bad_request("metadata.lora: an adapter's name", "metadata")
    if not backend_of(request).info.enable_lora:
        raise bad_request("metadata.lora: this server serves no adapters", "metadata")
    if await model_adapter(request, name) is None:
        raise bad_request("metadata.lora: name an adapter, not the base model", "metadata")


class OnAdapter:
    """`backend` with every request run on adapter `lora` (what the request path takes)."""

    def __init__(self, backend: EngineBackend, lora: str) -> None:
        self.backend = backend
        self.lora = lora

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        return self.backend.generate(prompt_ids, params, request_id, routing_key, lora=self.lora)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def on_adapter(backend: EngineBackend, lora: str | None) -> Any:
    return backend if lora is None else OnAdapter(backend, lora)


async def adapter_cards(request: Request, created: int) -> list[dict[str, Any]]:
    """One /v1/models card per registered adapter (vLLM's shape)."""
    backend = backend_of(request)
    info = backend.info
    if not info.enable_lora:
        return []
    adapters = await backend.control.list_loras()
    _names(request).names = {a["name"] for a in adapters}
    return [
        {
            "id": a["name"],
            "object": "model",
            "created": created,
            "owned_by": "raylane",
            "root": a["path"],
            "parent": info.name,
            "max_model_len": info.max_model_len,
            "lora_version": a.get("version"),  # raylane's: the adapter's newest version
        }
        for a in adapters
    ]
