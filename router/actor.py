"""The Router: one named Ray actor per cluster that owns the engine replicas, their table, the
control plane and the multi-turn session registry.

It creates the replicas (plain Ray actors, `router/replica_set.py`) to match the spec the Serve
app deploys, health-checks them and replaces those that fail. Replicas heartbeat here while
alive (weight version, requests held); the table, with each replica's actor handle, is what
every caller copies into its `ReplicaView` (router/replica_view.py) in the background and
routes on locally: no request calls the Router. A session turn calls it to plan the turn and to
commit it (the registry lives here, `router/session_host.py`); its tokens go from the replica
to the caller over the caller's own output channel (`router/turn_handoff.py`). The RL control
plane (pause, resume, weight updates, aborts; `router/control.py`) runs here too, so one lock
serializes it for the whole cluster, and it calls each replica's actor handle directly.

An async actor (the session methods are coroutines): every method, the sync replica-table ones
included, runs on the actor's event loop, so none may block.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Collection
from contextlib import aclosing
from typing import Any

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.control import CONTROL_VERBS, ControlPlane
from raylane.router.messages import Message
from raylane.router.names import NAMESPACE, ROUTER_NAME
from raylane.router.policy import RoutingPolicy
from raylane.router.remote import dispatch
from raylane.router.replica_calls import ActorCalls
from raylane.router.replica_set import ReplicaSet, ReplicaSpec
from raylane.router.replica_view import ReplicaView
from raylane.router.samples import TrainingSample
from raylane.router.session_host import SessionHost, SessionSetup
from raylane.router.session_store import open_session_store
from raylane.router.turn_handoff import hand_out_turn


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
        self._beats: dict[str, int] = {}  # heartbeats received, per replica
        self._held_on: dict[str, dict[str, int]] = {}  # per replica: requests held per channel
        self.replica_set = ReplicaSet(_own_handle, self.unregister, NAMESPACE)
        # with a DSN, sessions are written through to PostgreSQL and outlive a restart (Ray
        # restarts the actor with the same arguments); without one a restart loses them
        # in this process: the table is read before each turn's choice
        view = ReplicaView(
            lambda known: self.table(None, known), capacity, self.report_failure, refresh_s=0
        )
        self.sessions = SessionHost(view, store=open_session_store(sessions_dsn))
        self.plane = ControlPlane(self, ActorCalls(self.replica_set.handles))

    # --- replicas -----------------------------------------------------------------------------

    def deploy(self, spec: ReplicaSpec) -> bool:
        """Run `spec.count` replicas of `spec`'s engine (idempotent; replicas start in the
        background). False when a newer spec is deployed already."""
        return self.replica_set.deploy(spec)

    def stop_replicas(self) -> None:
        """Kill every engine replica (`raylane serve`'s shutdown)."""
        self.replica_set.stop()

    def register(self, replica_id: str) -> None:
        self.policy.add(replica_id, time.monotonic())
        self.heartbeat(replica_id)

    async def admit(self, replica_id: str) -> None:
        """A replica that starts: it first gets the LoRA adapters the cluster holds (loaded or
        pushed at runtime: router/lora_memory.py), then is registered."""
        import ray
        from raylane.router.replica_set import REPLICA_PREFIX

        handle = ray.get_actor(REPLICA_PREFIX + replica_id, namespace=NAMESPACE)
        replica = ActorCalls({replica_id: handle}).replica(replica_id)
        await self.plane.admit(replica, lambda: self.register(replica_id))

    def heartbeat(
        self,
        replica_id: str,
        weight_version: int | None = None,
        held: int | None = None,
        admitted: int | None = None,
        held_on: dict[str, int] | None = None,
        adapters: list[str] | None = None,
        lora_versions: dict[str, list[int]] | None = None,
    ) -> None:
        """The replica is alive, at this weight version, holding `held` requests (`held_on`:
        how many on each output channel that has some), having admitted `admitted` since it
        started (None: it does not say), with these LoRA `adapters` in its slots and these
        `lora_versions` held (per adapter)."""
        state = self.policy.replicas.get(replica_id)
        if state is None:  # the Router restarted and lost its table: re-learn the replica
            self.policy.add(replica_id, time.monotonic())
            state = self.policy.replicas[replica_id]
            self.replica_set.adopt()  # its handle
            self.plane.recall_from(replica_id)  # and the LoRA adapters it holds
        state.last_seen = time.monotonic()
        state.healthy = True
        self._beats[replica_id] = self._beats.get(replica_id, 0) + 1
        if weight_version is not None:
            self.policy.set_version(replica_id, weight_version)
        if held is not None:
            state.report(held)
            self._held_on[replica_id] = held_on or {}
        if admitted is not None:
            state.routed = admitted
        if adapters is not None:
            state.adapters = frozenset(adapters)
        if lora_versions is not None:
            state.set_lora_versions(lora_versions)

    def unregister(self, replica_id: str) -> None:
        self.policy.remove(replica_id)
        self._beats.pop(replica_id, None)
        self._held_on.pop(replica_id, None)

    def report_failure(self, replica_id: str) -> None:
        """A caller saw this replica fail: skip it until its next heartbeat."""
        self.policy.set_healthy(replica_id, False)

    def ready(self) -> bool:
        """Some replica can serve: healthy, at the cluster's weight version."""
        self._expire()
        return bool(self.policy.routable())

    async def table(
        self, spec: ReplicaSpec | None = None, known: Collection[str] = ()
    ) -> list[dict]:
        """The replicas, for a `ReplicaView`, with the actor handles of those not in `known`
        (the caller has them already: a replica id names one actor for good, so a refresh
        every `REFRESH_S` does not ship and register every handle again). The Serve app's
        ingress sends its `spec` along, so a restarted Router runs its replicas again."""
        if spec is not None:
            self.deploy(spec)
        self.replica_set.adopt()
        handles, beats, held_on = self.replica_set.handles, self._beats, self._held_on
        return [
            {
                **row,
                "handle": None if rid in known else handles[rid],
                "beat": beats.get(rid),
                "held_on": held_on.get(rid, {}),
            }
            for row in self.replicas()
            if (rid := row["replica_id"]) in handles
        ]

    def replicas(self) -> list[dict]:
        self._expire()
        return [
            {
                "replica_id": r.replica_id,
                "held": r.reported,
                "in_flight": r.in_flight,
                "routed": r.routed,
                "healthy": r.healthy,
                "weight_version": r.weight_version,
                "adapters": sorted(r.adapters),
                "lora_versions": {name: sorted(v) for name, v in r.lora_versions.items()},
            }
            for r in self.policy.replicas.values()
        ]

    # --- the control plane: straight to each replica's actor handle ---------------------------

    async def control(self, verb: str, *args: Any) -> Any:
        """`ControlPlane.<verb>(*args)`: every control call from another process comes here
        (`raylane.serve_backend.RouterControl`), and its verbs are the plane's own methods."""
        return await dispatch(self.plane, CONTROL_VERBS, verb, args)

    # --- the control plane's `ReplicaTable` ---------------------------------------------------

    def reachable(self) -> list[str]:
        self._expire()
        handles = self.replica_set.handles
        return [r.replica_id for r in self.policy.healthy() if r.replica_id in handles]

    def weight_version(self) -> int:
        self._expire()
        return self.policy.weight_version

    def set_version(self, replica_id: str, version: int) -> None:
        self.policy.set_version(replica_id, version)

    # --- sessions (`setup`: the caller's, so a restarted Router can serve stored sessions) ---

    # the `SessionBackend` calls, which `RouterSessions` forwards, on `setup`'s registry

    async def session_create(self, setup: SessionSetup, metadata: dict | None = None) -> str:
        return await (await self.sessions.registry(setup)).create(metadata)

    async def session_describe(self, setup: SessionSetup, session_id: str) -> dict[str, Any]:
        return await (await self.sessions.registry(setup)).describe(session_id)

    async def session_delete(self, setup: SessionSetup, session_id: str) -> None:
        await (await self.sessions.registry(setup)).delete(session_id)

    async def session_sample(
        self, setup: SessionSetup, session_id: str, max_seq_len: int | None = None
    ) -> TrainingSample:
        return await (await self.sessions.registry(setup)).sample(session_id, max_seq_len)

    async def session_turn(
        self,
        setup: SessionSetup,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """One turn of the session registry, generated by the caller; its start
        (`open_turn`) and end (`commit`) run here (router/turn_handoff.py). Call with
        `.options(num_returns="streaming")`. Yields the turn's `TurnTicket`, then, once
        `session_turn_end` handed the output back, the committed `TurnResult`. Cancelling the
        call leaves the session as it was."""
        registry = await self.sessions.registry(setup)
        opening = registry.open_turn(
            session_id, messages, params, tools=tools, chat_template_kwargs=chat_template_kwargs
        )
        turn = hand_out_turn(registry, opening, self.sessions.handoff)
        async with aclosing(turn) as items:
            async for item in items:
                yield item

    def session_turn_end(self, turn_id: str, output: RequestOutput) -> None:
        """The finished output of a turn that `session_turn` handed out."""
        self.sessions.handoff.finish(turn_id, output)

    def session_turns_renew(self, turn_ids: list[str]) -> None:
        """The caller of these turns is alive and generating them (`TurnLeases`)."""
        self.sessions.handoff.renew(turn_ids)

    def _expire(self) -> None:
        now = time.monotonic()
        for state in list(self.policy.replicas.values()):
            silent = now - state.last_seen
            if silent > self.forget_after_s:
                self.policy.remove(state.replica_id)
            elif silent > self.heartbeat_timeout_s:
                state.healthy = False


def _own_handle() -> Any:
    import ray

    return ray.get_runtime_context().current_actor


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
