"""What the HTTP layer needs from the cluster, as a small protocol the layer above injects.

`build_app(backend)` only talks to an `EngineBackend`. One class, `Backend`, is it wherever the
engines are: its request path (a `Requests`) and the session and control objects it is given
decide where. `local_backend` builds one over an in-process AsyncLLMEngine (tests,
single-process serving), `raylane.serve_backend.serve_backend` one over the Router actor and the
engine replicas. Its `sessions` (a `SessionBackend`) serve the session routes, its `control` (a
`ControlBackend`) the admin routes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.control import ControlPlane
from raylane.router.generator import Requests, RequestTurnGenerator
from raylane.router.messages import Message
from raylane.router.replica_calls import LocalReplica
from raylane.router.samples import TrainingSample
from raylane.router.session import TurnDelta
from raylane.router.sessions import SessionConfig, SessionRegistry, TurnResult
from raylane.router.tito import TemplateSplicer


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients send as "model"
    max_model_len: int
    vocab_size: int
    # how it is served, for the trainer protocols' info routes (/get_world_size, /server_info)
    model_path: str = ""  # the HF directory every replica loads
    replicas: int = 1
    tensor_parallel_size: int = 1
    dtype: str = "auto"  # EngineConfig.dtype
    routed_experts: bool = False  # a MoE model whose replicas capture routed experts
    batch_invariant: bool = False  # EngineConfig.batch_invariant (/v1/models, /server_info)
    enable_lora: bool = False  # EngineConfig.enable_lora: `model` may name an adapter
    max_loras: int = 0  # EngineConfig's, when enable_lora (vLLM's /server_info lora_config)
    max_lora_rank: int = 0


class SessionBackend(Protocol):
    """Multi-turn sessions: a `raylane.router.sessions.SessionRegistry` in process, or
    `raylane.serve_backend.RouterSessions` over the Router actor, which hosts one. Errors are
    the registry's (each a `raylane.router.errors.SessionError` with its HTTP status)."""

    async def create(self, metadata: dict[str, Any] | None = None) -> str: ...

    async def describe(self, session_id: str) -> dict[str, Any]: ...

    async def delete(self, session_id: str) -> None: ...

    def chat_stream(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        lora_version: int | None = None,
    ) -> AsyncGenerator[TurnResult, None]:
        """The turn's cumulative progress, then its committed result (`message` set):
        `chat_deltas`, each output folded into everything so far."""
        ...

    def chat_deltas(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        lora_version: int | None = None,
    ) -> AsyncGenerator[TurnDelta, None]:
        """The turn's deltas as the engine made them; the last, the finished one, with the
        committed result (`TurnDelta.committed`: `message` set, no replay blobs). Closing the
        iterator early aborts the turn and leaves no trace. Past `timeout_s` seconds the turn
        is aborted where it runs (the engine request too) and commits its partial output,
        finish reason "abort" (`SessionRegistry.chat_deltas`). `lora_version`: that version
        of the session's adapter (409 once it is no longer held; None: the newest)."""
        ...

    async def sample(self, session_id: str, max_seq_len: int | None = None) -> TrainingSample: ...


# The RL control plane over every engine replica: the plane itself in process (`local_backend`),
# or the Router's from another process (`raylane.serve_backend.RouterControl`, the same
# methods, each run in the Router). Its errors — `ValueError` for bad input,
# `raylane.router.errors.ControlError`s with their HTTP status — arrive as they are.
ControlBackend = ControlPlane


class EngineBackend(Requests, Protocol):
    """The engine side of the HTTP surface: the request path (`Requests`: generate, ready,
    stats), the model, and the sessions and control plane over the same engines."""

    info: ModelInfo
    tokenizer: Any  # a transformers tokenizer (chat template, encode/decode) loaded locally
    sessions: SessionBackend
    control: ControlBackend


class Backend:
    """The `EngineBackend`: requests go to `requests`, the session and admin routes to
    `sessions` and `control`."""

    def __init__(
        self,
        requests: Requests,
        tokenizer: Any,
        info: ModelInfo,
        sessions: SessionBackend,
        control: ControlBackend,
    ) -> None:
        self.requests = requests
        self.tokenizer = tokenizer
        self.info = info
        self.sessions = sessions
        self.control = control

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
        lora: str | None = None,  # an adapter's name (None: the base model)
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        if lora is None:  # every `Requests` takes this form
            return self.requests.generate(prompt_ids, params, request_id, routing_key)
        return self.requests.generate(prompt_ids, params, request_id, routing_key, lora=lora)

    async def ready(self) -> bool:
        return await self.requests.ready()

    async def stats(self) -> list[dict]:
        return await self.requests.stats()


def local_backend(
    engine: Any, model_name: str, session_config: SessionConfig | None = None
) -> Backend:
    """A `Backend` over one in-process `AsyncLLMEngine` (`LocalReplica`): its own session
    registry, the control plane itself with the engine as its only replica."""
    cfg = engine.engine.config
    validator = engine.engine.validator
    # capture routed experts for the sessions' training samples when the engine can
    capture = cfg.enable_return_routed_experts and validator.num_moe_layers > 0
    info = ModelInfo(
        model_name,
        cfg.max_model_len,
        validator.vocab_size,
        model_path=cfg.model,
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=cfg.dtype,
        routed_experts=capture,
        batch_invariant=cfg.batch_invariant,
        enable_lora=cfg.enable_lora,
        max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank,
    )
    # likewise a DSA model's indexer top-k
    picks = cfg.enable_return_indexer_topk and validator.num_dsa_layers > 0
    local = LocalReplica(engine)
    # sessions record the model by its path, as the Router's do (`SessionSetup.model_dir`)
    sessions = SessionRegistry(
        TemplateSplicer(engine.tokenizer),
        RequestTurnGenerator(local, return_routed_experts=capture, return_indexer_topk=picks),
        session_config,
        model=cfg.model,
    )
    return Backend(local, engine.tokenizer, info, sessions, ControlPlane(local, local))
