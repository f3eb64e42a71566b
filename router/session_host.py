"""The Router's session registry: one per cluster, so the HTTP ingress replicas stay stateless.

The ingress sends a `SessionSetup` with every session call (the model directory for the
chat template, the engine deployment's handle, whether routed experts are captured); the first
one builds the registry — after a Router restart too, so a stored session carries on — and a
different one — the app was redeployed with another model — rebuilds it. Turns run on the
engine replicas through `ReplicaTurnGenerator`, sticky by session id.

Sessions live in the Router's memory and are written through to its `SessionStore`: with
PostgreSQL (a DSN configured) they survive a Router restart; memory only, a restart forgets them
(their ids become 404). Each records its model (`SessionSetup.model_dir`): a stored session
asked for after a redeploy with another model is a 409 (`SessionModelMismatch`), never served
with the wrong chat template.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from actors.engine.sampling_params import SamplingParams
from router.errors import SessionNotFound
from router.messages import Message
from router.replica_generator import ReplicaPicker, ReplicaRequests, ReplicaTurnGenerator
from router.samples import TrainingSample
from router.session_store import MemorySessionStore, SessionStore
from router.sessions import SessionConfig, SessionRegistry, TurnResult
from router.tito import TemplateSplicer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionSetup:
    """What the Router needs to host sessions for the served model."""

    model_dir: str  # its tokenizer's chat template builds the prompt ids; sessions record it
    replicas: Any = field(compare=False)  # the engine deployment's DeploymentHandle
    return_routed_experts: bool = False  # the engines capture routed experts (MoE)
    config: SessionConfig = field(default_factory=SessionConfig)

    @property
    def key(self) -> tuple:
        # handles do not compare equal across pickling; their names do
        return (self.model_dir, self.replicas.app_name, self.replicas.deployment_name,
                self.return_routed_experts, self.config)


def auto_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def without_blobs(result: TurnResult) -> TurnResult:
    """The result as the client gets it: the record keeps the replay blobs, the reply omits
    them (and they do not cross the wire to the ingress)."""
    if result.output.routed_experts is None:
        return result
    return dataclasses.replace(result, output=dataclasses.replace(result.output,
                                                                  routed_experts=None))


class SessionHost:
    def __init__(self, picker: ReplicaPicker,
                 load_tokenizer: Callable[[str], Any] = auto_tokenizer,
                 store: SessionStore | None = None) -> None:
        self.picker = picker
        self.load_tokenizer = load_tokenizer
        self.store = store or MemorySessionStore()  # shared by every registry built here
        self._registry: SessionRegistry | None = None
        self._key: tuple | None = None
        self._lock = asyncio.Lock()

    @property
    def num_sessions(self) -> int:
        return 0 if self._registry is None else len(self._registry)

    async def create(self, setup: SessionSetup, metadata: dict[str, Any] | None = None) -> str:
        if setup.key != self._key:
            await self._configure(setup)
        return await self._registry.acreate(metadata)

    async def describe(self, session_id: str,
                       setup: SessionSetup | None = None) -> dict[str, Any]:
        return await (await self._registry_of(session_id, setup)).adescribe(session_id)

    async def delete(self, session_id: str, setup: SessionSetup | None = None) -> None:
        await (await self._registry_of(session_id, setup)).delete(session_id)

    async def sample(self, session_id: str, max_seq_len: int | None = None,
                     setup: SessionSetup | None = None) -> TrainingSample:
        registry = await self._registry_of(session_id, setup)
        return await registry.asample(session_id, max_seq_len)

    async def chat(self, session_id: str, messages: list[Message], params: SamplingParams | None,
                   tools: list[dict] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None,
                   setup: SessionSetup | None = None,
                   timeout_s: float | None = None) -> AsyncIterator[TurnResult]:
        """The turn's progress, then its committed result (see `SessionRegistry.chat_stream`,
        also for `timeout_s`), without replay blobs; leaving early aborts the turn and leaves no
        trace."""
        registry = await self._registry_of(session_id, setup)
        turn = registry.chat_stream(session_id, messages, params, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs,
                                    timeout_s=timeout_s)
        async with aclosing(turn):
            async for result in turn:
                yield without_blobs(result)

    async def _registry_of(self, session_id: str,
                           setup: SessionSetup | None) -> SessionRegistry:
        """The registry, built from `setup` when it is new here (a restarted Router)."""
        if setup is not None and setup.key != self._key:
            await self._configure(setup)
        if self._registry is None:  # nothing was created since the Router started
            raise SessionNotFound(session_id)
        return self._registry

    async def _configure(self, setup: SessionSetup) -> None:
        async with self._lock:  # every ingress replica may send its setup at once
            if setup.key == self._key:
                return
            # off the event loop: the replica table keeps answering meanwhile
            tokenizer = await asyncio.to_thread(self.load_tokenizer, setup.model_dir)
            generator = ReplicaTurnGenerator(ReplicaRequests(setup.replicas, self.picker),
                                             setup.return_routed_experts)
            if self.num_sessions:
                log.warning("the served model changed; forgetting %d sessions", self.num_sessions)
            self._registry = SessionRegistry(TemplateSplicer(tokenizer), generator, setup.config,
                                             store=self.store, model=setup.model_dir)
            self._key = setup.key
