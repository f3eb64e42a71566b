"""What the HTTP layer needs from the cluster, as a small protocol the layer above injects.

`build_app(backend)` only talks to an `EngineBackend`; `LocalBackend` runs one AsyncLLMEngine in
process (tests, single-process serving) and `raylane.serve` provides one over the Router actor
and the Ray Serve engine replicas. Its `sessions` (a `SessionBackend`) serve the session routes,
its `control` (a `ControlBackend`) the admin routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.control import ControlPlane
from raylane.router.errors import ReplicaFailed
from raylane.router.generator import EngineTurnGenerator
from raylane.router.messages import Message
from raylane.router.replica_calls import EngineCalls, EngineTable
from raylane.router.samples import TrainingSample
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
    ) -> AsyncGenerator[TurnResult, None]:
        """The turn's cumulative progress, then its committed result (`message` set), without
        replay blobs. Closing the iterator early aborts the turn and leaves no trace. Past
        `timeout_s` seconds the turn is aborted where it runs (the engine request too) and
        commits its partial output, finish reason "abort" (`SessionRegistry.chat_stream`)."""
        ...

    async def sample(self, session_id: str, max_seq_len: int | None = None) -> TrainingSample: ...


class ControlBackend(Protocol):
    """The RL control plane over every engine replica (see `raylane.router.control.ControlPlane`,
    whose errors — `ValueError` for bad input, `raylane.router.errors.ControlError`s with their
    HTTP status — these raise as they are)."""

    async def pause(self, mode: str) -> dict[str, Any]:
        """Pause in mode "abort", "wait", "keep" or "retract";
        `{"paused": True, "mode": mode, "weight_version": v}`."""
        ...

    async def resume(self) -> dict[str, Any]:
        """`{"paused": False, "weight_version": v}`."""
        ...

    async def begin_update(self, version: int | None, spec_dicts: list[dict] | None) -> str:
        """Open a weight update of these tensors ({"name", "shape", "dtype"}; None: each
        receive brings its own) to `version` (None: the commit's, or the next); its id."""
        ...

    async def load_bucket(self, update_id: str, payload: bytes) -> int:
        """Apply one bucket of safetensors bytes; how many tensors it held."""
        ...

    async def commit_update(self, update_id: str | None, version: int | None = None) -> int:
        """Switch every replica to the update's (None: the open one's) version, or `version`,
        which is returned."""
        ...

    async def init_weight_group(
        self, info: dict[str, Any], detach: bool = False
    ) -> dict[str, Any] | None:
        """Every rank joins the trainer's collective group (`GroupInfo`'s fields)."""
        ...

    async def receive_weights(
        self,
        update_id: str | None,
        group_name: str,
        spec_dicts: list[dict],
        packing: dict[str, Any] | None = None,
        detach: bool = False,
    ) -> int:
        """Receive broadcast tensors into the update (`ControlPlane.receive_weights`)."""
        ...

    async def destroy_weight_group(self, group_name: str | None = None) -> None: ...

    async def abort_update(self, update_id: str | None = None) -> None:
        """Drop the update: old weights and version everywhere, resumed if it paused."""
        ...

    async def weight_version(self) -> int: ...

    async def sleep(self, level: int) -> dict[str, Any]:
        """Pause ("abort") and free every replica's KV cache; `control_state()`."""
        ...

    async def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        """Allocate the KV caches again and resume; `control_state()`."""
        ...

    async def call_replicas(self, method: str, *args: Any) -> dict[str, Any]:
        """`raylane.actors.engine.upkeep.CONTROL_CALLS` on every replica, answers by id."""
        ...

    async def set_weight_version(self, version: int) -> int:
        """Switch every replica to `version` (newer) with the weights they hold."""
        ...

    async def control_state(self) -> dict[str, Any]:
        """`{"paused": bool, "mode"?: mode, "weight_version": v}` (`ControlPlane.state`)."""
        ...

    async def abort(self, request_ids: list[str] | None) -> list[RequestOutput]:
        """The partial outputs of the requests this ended (finish reason "abort"); None
        ends every request the replicas run."""
        ...

    async def flush_cache(self) -> None: ...


class EngineBackend(Protocol):
    """The engine side of the HTTP surface."""

    info: ModelInfo
    tokenizer: Any  # a transformers tokenizer (chat template, encode/decode) loaded locally
    sessions: SessionBackend
    control: ControlBackend

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """The engine's deltas for one request (what each step added; the prompt on the
        first); closing the iterator early aborts it.

        Raises `ValueError` for bad input, `raylane.router.errors.ReplicasBusy` (429) and
        `ReplicaFailed` (503).
        """
        ...

    async def ready(self) -> bool:
        """True when at least one replica can serve."""
        ...

    async def stats(self) -> list[dict]:
        """One `EngineStats.snapshot()` per live replica, for /metrics."""
        ...


class LocalBackend:
    """One in-process AsyncLLMEngine behind the protocol, with its own session registry."""

    def __init__(self, engine, model_name: str, session_config: SessionConfig | None = None):
        from raylane.actors.engine.async_engine import AsyncLLMEngine

        self.engine: AsyncLLMEngine = engine
        self.tokenizer = engine.tokenizer
        cfg = engine.engine.config
        validator = engine.engine.validator
        # capture routed experts for the sessions' training samples when the engine can
        capture = cfg.enable_return_routed_experts and validator.num_moe_layers > 0
        self.info = ModelInfo(
            model_name,
            cfg.max_model_len,
            validator.vocab_size,
            model_path=cfg.model,
            tensor_parallel_size=cfg.tensor_parallel_size,
            dtype=cfg.dtype,
            routed_experts=capture,
        )
        # likewise a DSA model's indexer top-k
        picks = cfg.enable_return_indexer_topk and validator.num_dsa_layers > 0
        generator = EngineTurnGenerator(
            engine, return_routed_experts=capture, return_indexer_topk=picks
        )
        # sessions record the model by its path, as the Router's do (`SessionSetup.model_dir`)
        self.sessions = SessionRegistry(
            TemplateSplicer(self.tokenizer), generator, session_config, model=cfg.model
        )
        # the control plane itself, with the engine as its only replica
        self.control = ControlPlane(EngineTable(engine), EngineCalls(engine))

    async def generate(self, prompt_ids, params, request_id, routing_key=None):
        try:
            self.engine.check_health()
        except RuntimeError as e:
            raise ReplicaFailed(str(e)) from e
        deltas = self.engine.generate_deltas(prompt_ids, params, request_id)
        async with contextlib.aclosing(deltas) as it:
            async for out in it:
                yield out

    async def ready(self) -> bool:
        try:
            self.engine.check_health()
        except RuntimeError:
            return False
        return True

    async def stats(self) -> list[dict]:
        return [self.engine.stats_snapshot()]
