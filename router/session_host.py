"""The Router's session registry: one per cluster, so the HTTP ingress replicas stay stateless.

The ingress sends a `SessionSetup` with every session call (the model directory for the
chat template, whether routed experts are captured); the first
one builds the registry — after a Router restart too, so a stored session carries on — and a
different one — the app was redeployed with another model — rebuilds it. A turn's tokens do not
pass through here: the registry plans and commits it, the caller generates it over its own
output channel (`TurnHandoff`, router/turn_handoff.py).

Sessions live in the Router's memory and are written through to its `SessionStore`: with
PostgreSQL (a DSN configured) they survive a Router restart; memory only, a restart forgets them
(their ids become 404). Each records its model (`SessionSetup.model_dir`): a stored session
asked for after a redeploy with another model is a 409 (`SessionModelMismatch`), never served
with the wrong chat template.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raylane.router.replica_view import ReplicaView
from raylane.router.session_store import MemorySessionStore, SessionStore
from raylane.router.sessions import SessionConfig, SessionRegistry
from raylane.router.tito import TemplateSplicer
from raylane.router.turn_handoff import TurnHandoff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionSetup:
    """What the Router needs to host sessions for the served model."""

    model_dir: str  # its tokenizer's chat template builds the prompt ids; sessions record it
    return_routed_experts: bool = False  # the engines capture routed experts (MoE)
    config: SessionConfig = field(default_factory=SessionConfig)
    return_indexer_topk: bool = False  # the engines capture indexer top-k (DSA)

    @property
    def key(self) -> tuple:
        return (self.model_dir, self.return_routed_experts, self.config, self.return_indexer_topk)


def auto_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class SessionHost:
    """Builds the Router's `SessionRegistry` for the served model and keeps it while the
    model stays the same."""

    def __init__(
        self,
        view: ReplicaView,
        load_tokenizer: Callable[[str], Any] = auto_tokenizer,
        store: SessionStore | None = None,
    ) -> None:
        self.view = view
        self.load_tokenizer = load_tokenizer
        self.store = store or MemorySessionStore()  # shared by every registry built here
        self.handoff = TurnHandoff()  # the registries' generator: turns run at the caller
        self._registry: SessionRegistry | None = None
        self._key: tuple | None = None
        self._lock = asyncio.Lock()

    @property
    def num_sessions(self) -> int:
        return 0 if self._registry is None else len(self._registry)

    async def registry(self, setup: SessionSetup) -> SessionRegistry:
        """The registry for `setup`'s model, built when it is new here (the first call, a
        restarted Router, a redeployed model)."""
        if setup.key != self._key:
            await self._configure(setup)
        assert self._registry is not None  # _configure built it for this key
        return self._registry

    async def _configure(self, setup: SessionSetup) -> None:
        async with self._lock:  # every ingress replica may send its setup at once
            if setup.key == self._key:
                return
            # off the event loop: the replica table keeps answering meanwhile
            tokenizer = await asyncio.to_thread(self.load_tokenizer, setup.model_dir)
            if self.num_sessions:
                log.warning("the served model changed; forgetting %d sessions", self.num_sessions)
            self._registry = SessionRegistry(
                TemplateSplicer(tokenizer),
                self.handoff,
                setup.config,
                store=self.store,
                model=setup.model_dir,
            )
            self._key = setup.key
