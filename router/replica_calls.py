"""How the control plane reaches engine replicas: the Router's replica actors through their
handles (`ActorCalls`), or one in-process engine (`LocalReplica`, for `local_backend`). Either
way `calls.replica(id)` is that replica's `ReplicaControl`, run there or here. `LocalReplica` is
also that engine's request path (`Requests`, router/generator.py), as `ReplicaRequests` is the
replicas'."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.replica_control import ReplicaControl
from raylane.actors.replica_lora import adapter
from raylane.router.errors import ReplicaFailed, unwrapped
from raylane.router.remote import Remote, verbs

REPLICA_VERBS = verbs(ReplicaControl)
__all__ = ["ActorCalls", "LocalReplica"]


class ActorCalls:
    """`ReplicaCalls` over the replicas' actor handles (`handles`: the Router's, by id): each
    verb of `replica(id)` is one call to that replica's actor, which runs `ReplicaControl`'s."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles

    def replica(self, replica_id: str) -> ReplicaControl:
        async def send(verb: str, args: tuple) -> Any:
            handle = self.handles.get(replica_id)
            if handle is None:  # raised when awaited: a failure of this replica's call alone
                raise RuntimeError(f"engine replica {replica_id} is gone")
            return await _result(getattr(handle, verb).remote(*args))

        return cast(ReplicaControl, Remote(REPLICA_VERBS, send))


async def _result(ref: Any) -> Any:
    try:
        return await ref
    except Exception as e:
        raise unwrapped(e) from None


class LocalReplica:
    """One in-process engine (an `AsyncLLMEngine`) as the only replica: the control plane's
    `ReplicaTable` (always reachable, at the engine's version) and `ReplicaCalls` (the engine's
    `ReplicaControl`, called here), and the request path's `Requests`."""

    REPLICA_ID = "local"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.control = ReplicaControl(engine)

    def replica(self, replica_id: str) -> ReplicaControl:
        return self.control

    def reachable(self) -> list[str]:
        return [self.REPLICA_ID]

    def weight_version(self) -> int:
        return self.engine.weight_version

    def set_version(self, replica_id: str, version: int) -> None:
        pass  # the engine's own version is the truth

    def report_failure(self, replica_id: str) -> None:
        pass  # its health is `check_health`'s business

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,  # one replica: nothing to route
        lora: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        try:
            self.engine.check_health()
        except RuntimeError as e:  # the step loop died: as a dead replica's request would
            raise ReplicaFailed(str(e)) from e
        deltas = self.engine.generate_deltas(prompt_ids, params, request_id, **adapter(lora))
        async with aclosing(deltas) as it:
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
