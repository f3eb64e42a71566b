"""The HTTP layer's `Backend` over the Router actor and its engine replicas (`serve_backend`).

Requests go from here straight to a replica's actor handle, chosen on this process's copy of the
Router's replica table (`ReplicaView`, through `ReplicaRequests`); control calls
(`RouterControl`) and sessions (`RouterSessions`) go to the Router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, cast

import numpy as np
from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.control import CONTROL_VERBS, ControlPlane
from raylane.router.errors import ROUTER_DOWN, ReplicaFailed, call_router
from raylane.router.generator import RequestTurnGenerator, TurnGenerator
from raylane.router.messages import Message
from raylane.router.remote import Remote
from raylane.router.replica_requests import ReplicaRequests
from raylane.router.replica_set import ReplicaSpec
from raylane.router.replica_view import ReplicaView
from raylane.router.samples import TrainingSample
from raylane.router.session import TurnDelta
from raylane.router.session_host import SessionSetup
from raylane.router.session_progress import CumulativeTurns
from raylane.router.turn_handoff import TurnLeases, stream_turn
from raylane.session_server.backend import Backend, ModelInfo


def router_view(router: Any, capacity: int, spec: ReplicaSpec | None = None) -> ReplicaView:
    """A `ReplicaView` of the Router's table (with `spec`: the app's, which the Router then
    runs). A failed request's replica is reported to the Router, once, off the request path."""
    return ReplicaView(
        lambda known: call_router(router.table.remote(spec, known)),
        capacity,
        report=lambda replica_id: router.report_failure.remote(replica_id),
    )


def serve_backend(
    router: Any,
    tokenizer: Any,
    info: ModelInfo,
    setup: SessionSetup,
    spec: ReplicaSpec | None = None,
    capacity: int = 256,
) -> Backend:
    """Choose a replica locally, then stream from that replica directly; sessions and control
    in the Router."""
    requests = ReplicaRequests(router_view(router, capacity, spec))
    turns = RequestTurnGenerator(requests, setup.return_routed_experts, setup.return_indexer_topk)
    sessions = RouterSessions(router, setup, turns)
    return Backend(requests, tokenizer, info, sessions, router_control(router))


class RouterControl(Remote):
    """The Router's `ControlPlane` seen from another process: each verb is one call to the
    Router (`Router.control`), whose plane serializes control calls for the whole cluster.
    `result` awaits the call (default `call_router`: the Router's errors as themselves)."""

    def __init__(self, router, result: Callable[[Any], Awaitable[Any]] = call_router):
        super().__init__(
            CONTROL_VERBS, lambda verb, args: result(router.control.remote(verb, *args))
        )

    async def load_bucket(self, update_id: str, bucket: Any) -> int:
        """`bucket`: safetensors bytes, stored here once for every replica; or `[ObjectRef]`
        of them, stored already. In a list, so the Router passes the ref on instead of
        fetching the bytes. NOTE: the ref must live until the call returns (a uint8 array,
        which a replica reads in place; bytes would be copied out)."""
        if not isinstance(bucket, list):
            import ray

            bucket = [await asyncio.to_thread(ray.put, np.frombuffer(bucket, dtype=np.uint8))]
        return await self._send("load_bucket", (update_id, bucket))


def router_control(router, result: Callable[[Any], Awaitable[Any]] = call_router) -> ControlPlane:
    """The Router's control plane, to call as if it were here (`RouterControl`)."""
    return cast(ControlPlane, RouterControl(router, result))


class RouterSessions(CumulativeTurns):
    """`SessionBackend` over the Router actor, which hosts the session registry (so ingress
    replicas stay stateless) and runs each turn on the session's replica."""

    def __init__(self, router, setup: SessionSetup, generator: TurnGenerator):
        self.router = router
        # sent with every call: the Router (re)builds its registry from it, after a restart too
        self.setup = setup
        self.generator = generator  # runs a turn's tokens (a `RequestTurnGenerator`)
        self.leases = TurnLeases(self._renew)  # while this process runs turns, the Router knows

    async def create(self, metadata: dict[str, Any] | None = None) -> str:
        return await call_router(self.router.session_create.remote(self.setup, metadata))

    async def describe(self, session_id: str) -> dict[str, Any]:
        return await call_router(self.router.session_describe.remote(self.setup, session_id))

    async def delete(self, session_id: str) -> None:
        await call_router(self.router.session_delete.remote(self.setup, session_id))

    async def sample(self, session_id: str, max_seq_len: int | None = None) -> TrainingSample:
        ref = self.router.session_sample.remote(self.setup, session_id, max_seq_len)
        return await call_router(ref)

    async def chat_deltas(
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
        from ray.exceptions import RayActorError

        # the Router opens and commits the turn; its deltas come here over this process's
        # output channel to the replica, and the deadline runs here (router/turn_handoff.py)
        call = self.router.session_turn.options(num_returns="streaming").remote(
            self.setup, session_id, messages, params, tools, chat_template_kwargs
        )
        committed = False
        turn = stream_turn(
            _results(call),
            self.generator,
            self._hand_back,
            self.leases,
            session_id,
            timeout_s,
            lora_version,
        )
        try:
            async with aclosing(turn):
                async for step in turn:
                    committed = step.committed is not None
                    yield step
        except RayActorError as e:  # the stream itself may report the Router's death
            raise ReplicaFailed(ROUTER_DOWN) from e
        finally:
            if not committed:  # the Router forgets the turn: the session stays as it was
                _cancel(call)

    async def _hand_back(self, turn_id: str, output: RequestOutput) -> None:
        await call_router(self.router.session_turn_end.remote(turn_id, output))

    async def _renew(self, turn_ids: list[str]) -> None:
        await call_router(self.router.session_turns_renew.remote(turn_ids))


async def _results(call) -> AsyncIterator:
    """The Router's streamed items, each awaited through `call_router` (its errors)."""
    async for ref in call:
        yield call_router(ref)


def _cancel(call) -> None:
    import ray

    ray.cancel(call)
