"""The Router: one named Ray actor per cluster that owns the replica table, the routing policy
and the multi-turn session registry.

Engine replicas register on start and heartbeat while alive; the HTTP ingress asks `choose()`
which replica serves a request, then streams from that replica directly (tokens never pass
through here) and reports `done()` / `report_failure()`. Session turns are the exception: the
registry records every token, so they run here (see `router/session_host.py`), on the replica
the policy picks for the session id. The RL control plane (pause, resume, weight updates, aborts;
`router/control.py`) runs here too, so one lock serializes it for the whole cluster; callers pass
the engine deployment's handle, through which it reaches every replica.

An async actor (the session methods are coroutines): every method, the sync replica-table ones
included, runs on the actor's event loop, so none may block.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.control import ControlPlane
from raylane.router.messages import Message
from raylane.router.policy import RoutingPolicy
from raylane.router.replica_calls import HandleCalls
from raylane.router.replica_generator import PolicyPicker
from raylane.router.session_host import SessionHost, SessionSetup
from raylane.router.session_store import open_session_store
from raylane.router.sessions import TurnResult

ROUTER_NAME = "raylane-router"
SESSION_CALLS = frozenset({"create", "describe", "delete", "sample"})
NAMESPACE = "raylane"


class Router:
    def __init__(
        self,
        capacity: int = 256,
        heartbeat_timeout_s: float = 5.0,
        forget_after_s: float = 60.0,
        sessions_dsn: str | None = None,
    ):
        self.policy = RoutingPolicy(capacity)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s
        # with a DSN, sessions are written through to PostgreSQL and outlive a restart (Ray
        # restarts the actor with the same arguments); without one a restart loses them
        self.sessions = SessionHost(PolicyPicker(self), store=open_session_store(sessions_dsn))
        self.control = ControlPlane(self)

    # --- replicas -----------------------------------------------------------------------------

    def register(self, replica_id: str) -> None:
        self.policy.add(replica_id, time.monotonic())
        self.heartbeat(replica_id)

    def heartbeat(
        self, replica_id: str, weight_version: int | None = None, held: int | None = None
    ) -> None:
        """The replica is alive, at this weight version, holding `held` requests (None: it
        does not say)."""
        state = self.policy.replicas.get(replica_id)
        if state is None:  # the Router restarted and lost its table: re-learn the replica
            self.policy.add(replica_id, time.monotonic())
            state = self.policy.replicas[replica_id]
        state.last_seen = time.monotonic()
        state.healthy = True
        if weight_version is not None:
            self.policy.set_version(replica_id, weight_version)
        if held is not None:
            state.report(held)

    def unregister(self, replica_id: str) -> None:
        self.policy.remove(replica_id)

    def report_failure(self, replica_id: str) -> None:
        """The ingress saw this replica fail: skip it until its next heartbeat."""
        self.policy.set_healthy(replica_id, False)

    # --- routing ------------------------------------------------------------------------------

    def choose(self, routing_key: str | None = None) -> str | None:
        """The replica for a request, counted as in flight; None when all are full or down."""
        self._expire()
        replica_id = self.policy.choose(routing_key)
        if replica_id is not None:
            self.policy.started(replica_id)
        return replica_id

    def done(self, replica_id: str) -> None:
        self.policy.finished(replica_id)

    def ready(self) -> bool:
        """Some replica can serve: healthy, at the cluster's weight version."""
        self._expire()
        return bool(self.policy.routable())

    def replicas(self) -> list[dict]:
        self._expire()
        return [
            {
                "replica_id": r.replica_id,
                "in_flight": r.in_flight,
                "routed": r.routed,
                "healthy": r.healthy,
                "weight_version": r.weight_version,
            }
            for r in self.policy.replicas.values()
        ]

    # --- the control plane (`replicas`: the engine deployment's DeploymentHandle) ------------

    async def pause(self, replicas, mode: str) -> dict[str, Any]:
        return await self.control.pause(HandleCalls(replicas), mode)

    async def resume(self, replicas) -> dict[str, Any]:
        return await self.control.resume(HandleCalls(replicas))

    async def begin_update(self, replicas, version: int, spec_dicts: list[dict]) -> str:
        return await self.control.begin_update(HandleCalls(replicas), version, spec_dicts)

    async def load_bucket(self, replicas, update_id: str, bucket: list) -> int:
        """`bucket`: `[ObjectRef]` of safetensors bytes; the list keeps Ray from fetching the
        bytes here, so each replica reads them from the object store itself."""
        return await self.control.load_bucket(HandleCalls(replicas), update_id, bucket)

    async def commit_update(self, replicas, update_id: str) -> int:
        return await self.control.commit_update(HandleCalls(replicas), update_id)

    async def abort(self, replicas, request_ids: list[str]) -> list[RequestOutput]:
        return await self.control.abort(HandleCalls(replicas), request_ids)

    async def flush_cache(self, replicas) -> None:
        await self.control.flush_cache(HandleCalls(replicas))

    def control_state(self) -> dict[str, Any]:
        return self.control.state()

    # --- the control plane's `ReplicaTable` ---------------------------------------------------

    def reachable(self) -> list[str]:
        self._expire()
        return [r.replica_id for r in self.policy.healthy()]

    def weight_version(self) -> int:
        self._expire()
        return self.policy.weight_version

    def set_version(self, replica_id: str, version: int) -> None:
        self.policy.set_version(replica_id, version)

    # --- sessions (`setup`: the caller's, so a restarted Router can serve stored sessions) ---

    async def session_call(self, setup: SessionSetup, method: str, *args: Any) -> Any:
        """`SessionRegistry.<method>(*args)` for one of `SESSION_CALLS`, on the registry of
        `setup`'s model (the `SessionBackend` protocol, which `RouterSessions` forwards)."""
        if method not in SESSION_CALLS:
            raise ValueError(f"no session call {method!r}; one of {sorted(SESSION_CALLS)}")
        registry = await self.sessions.registry(setup)
        return await getattr(registry, method)(*args)

    async def session_turn(
        self,
        setup: SessionSetup,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TurnResult]:
        """`SessionRegistry.chat_stream`; call with `.options(num_returns="streaming")`:
        cancelling the call aborts the turn. Past `timeout_s` the turn is aborted here, on its
        replica, and ends with its partial output (finish reason "abort"), which the session
        records."""
        registry = await self.sessions.registry(setup)
        turn = registry.chat_stream(
            session_id,
            messages,
            params,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            timeout_s=timeout_s,
        )
        async with aclosing(turn):
            async for result in turn:
                yield result

    def _expire(self) -> None:
        now = time.monotonic()
        for state in list(self.policy.replicas.values()):
            silent = now - state.last_seen
            if silent > self.forget_after_s:
                self.policy.remove(state.replica_id)
            elif silent > self.heartbeat_timeout_s:
                state.healthy = False


def get_or_create_router(capacity: int = 256, sessions_dsn: str | None = None):
    """The cluster's Router actor handle, created on first use (detached: it outlives callers,
    and an existing one keeps the arguments it was created with)."""
    import ray

    return (
        ray.remote(Router)
        .options(
            name=ROUTER_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_restarts=-1,
            # NOTE: never inside the caller's placement group (a Serve replica's), which it would
            # otherwise join and die with when Serve replaces that replica
            scheduling_strategy="DEFAULT",
        )
        .remote(capacity, sessions_dsn=sessions_dsn)
    )
