"""One request on the engine replicas, the same path for every caller: the HTTP ingress (its
plain requests and its session turns, `RequestTurnGenerator`) and the in-cluster rollout client:
the `Requests` (router/generator.py) over the replicas.

`ReplicaRequests.generate` asks its process's `ReplicaView` (router/replica_view.py: a copy of
the Router's table, chosen on locally) for a replica, streams the request from it over that
replica's output channel (router/replica_channels.py) through its actor handle, reports the
replica when it failed (not when this process let its output channel lapse), and says done.
No call goes to the Router.
Its failures are two `RouterError`s: `ReplicasBusy` (429) and `ReplicaFailed` (503); a
ValueError (bad input), EnginePaused and RequestFailed (its step failed; the replica is fine)
pass through as themselves.

Session turns go to the replica the policy picks for the session id, so a session sticks to one
replica and reuses its prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from raylane.actors.engine.errors import EnginePaused, RequestFailed
from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import ReplicaFailed, ReplicasBusy
from raylane.router.replica_channels import ChannelLapsed, ReplicaChannels
from raylane.router.replica_view import ReplicaView


class ReplicaRequests:
    """`Requests` over the engine replicas of `view`."""

    def __init__(self, view: ReplicaView) -> None:
        self.channels = ReplicaChannels()
        self.view = view
        view.channel_of = self.channels.channel_id  # the view counts this process's requests

    async def generate(
        self,
        prompt_ids: list[int] | str,  # text: the engine tokenizes it
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
        lora: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """The engine's deltas for the request (on adapter `lora`, if named); leaving early
        aborts it on its replica."""
        replica_id = await self._choose(routing_key, lora)
        handle = self.view.handle(replica_id)
        stream = self.channels.stream(replica_id, handle, prompt_ids, params, request_id, lora)
        try:
            async with aclosing(stream):
                async for out in stream:
                    yield out
        # the request's fault, a pause, or a step that failed only it: the replica is fine
        except (ValueError, EnginePaused, RequestFailed):
            raise
        except ChannelLapsed as e:  # this process stalled, not the replica: nothing to report
            raise ReplicaFailed(f"{e}; send it again") from e
        except Exception as e:
            self.view.report_failure(replica_id)
            raise ReplicaFailed(
                f"the engine replica failed while serving the request "
                f"({type(e).__name__}); send it again"
            ) from e
        finally:
            self.view.done(replica_id)

    async def ready(self) -> bool:
        return await self.view.ready()

    async def stats(self) -> list[dict]:
        await self.view.ready()
        healthy = [r.replica_id for r in self.view.policy.healthy()]
        calls = [self.view.handle(rid).stats.remote() for rid in healthy]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    async def _choose(self, routing_key: str | None, lora: str | None = None) -> str:
        replica_id = await self.view.choose(routing_key, lora)
        if replica_id is None:
            if not await self.view.ready():
                raise ReplicaFailed("no engine replica is ready")
            raise ReplicasBusy(
                "every engine replica is busy (or the one this routing key sticks to); retry later"
            )
        return replica_id
