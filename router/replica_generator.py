"""One request on the engine replicas, the same path for every caller: the HTTP ingress, the
Router's session turns and the in-cluster rollout client.

`ReplicaRequests.generate` asks a `ReplicaPicker` (the Router's policy: in the Router itself,
or through its actor handle) for a replica, streams the request from it over that replica's
output channel (router/replica_channels.py), reports the replica when it failed, and says done.
Its failures are two `RouterError`s: `ReplicasBusy` (429) and `ReplicaFailed` (503); a
ValueError (bad input), EnginePaused and RequestFailed (its step failed; the replica is fine)
pass through as themselves.

Session turns go to the replica the policy picks for the session id, so a session sticks to one
replica and reuses its prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from raylane.actors.engine.errors import EnginePaused, RequestFailed
from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import ReplicaFailed, ReplicasBusy, call_router
from raylane.router.generator import EngineTurnGenerator
from raylane.router.replica_channels import ReplicaChannels


class ReplicaPicker(Protocol):
    """The Router's replica table, as a request uses it."""

    async def choose(self, routing_key: str | None = None) -> str | None: ...

    async def ready(self) -> bool: ...

    def done(self, replica_id: str) -> None: ...

    def report_failure(self, replica_id: str) -> None: ...


class PolicyPicker:
    """`ReplicaPicker` inside the Router actor, over its own table."""

    def __init__(self, router: Any) -> None:
        self.router = router

    async def choose(self, routing_key: str | None = None) -> str | None:
        return self.router.choose(routing_key)

    async def ready(self) -> bool:
        return self.router.ready()

    def done(self, replica_id: str) -> None:
        self.router.done(replica_id)

    def report_failure(self, replica_id: str) -> None:
        self.router.report_failure(replica_id)


class RouterPicker:
    """`ReplicaPicker` over the Router actor's handle; a Router that died or restarts is
    `ReplicaFailed` (a 503), never a 500."""

    def __init__(self, router: Any) -> None:
        self.router = router

    async def choose(self, routing_key: str | None = None) -> str | None:
        return await call_router(self.router.choose.remote(routing_key))

    async def ready(self) -> bool:
        try:
            return await call_router(self.router.ready.remote())
        except ReplicaFailed:  # the Router is down: not ready until it is back
            return False

    def done(self, replica_id: str) -> None:
        self.router.done.remote(replica_id)

    def report_failure(self, replica_id: str) -> None:
        self.router.report_failure.remote(replica_id)


class ReplicaRequests:
    def __init__(self, handle: Any, picker: ReplicaPicker) -> None:
        self.channels = ReplicaChannels(handle)  # handle: the engine deployment's
        self.picker = picker

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of the request; leaving early aborts it on its replica."""
        replica_id = await self._choose(routing_key)
        stream = self.channels.stream(replica_id, prompt_ids, params, request_id)
        try:
            async with aclosing(stream):
                async for out in stream:
                    yield out
        # the request's fault, a pause, or a step that failed only it: the replica is fine
        except (ValueError, EnginePaused, RequestFailed):
            raise
        except Exception as e:
            self.picker.report_failure(replica_id)
            raise ReplicaFailed(
                f"the engine replica failed while serving the request "
                f"({type(e).__name__}); send it again"
            ) from e
        finally:
            self.picker.done(replica_id)

    async def _choose(self, routing_key: str | None) -> str:
        replica_id = await self.picker.choose(routing_key)
        if replica_id is None:
            if not await self.picker.ready():
                raise ReplicaFailed("no engine replica is ready")
            raise ReplicasBusy(
                "every engine replica is busy (or the one this routing key sticks to); retry later"
            )
        return replica_id


class ReplicaTurnGenerator(EngineTurnGenerator):
    """`TurnGenerator` over the engine replicas (`engine`: a `ReplicaRequests`), sticky by
    session id."""

    def _outputs(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, routing_key: str
    ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(prompt_ids, params, request_id, routing_key)
