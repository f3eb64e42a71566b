"""How the control plane reaches engine replicas: the Router's replica actors through their
handles, or one in-process engine (`LocalBackend`), behind the same `ReplicaCalls` /
`ReplicaTable`."""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.errors import EnginePaused, RequestFailed
from raylane.actors.engine.upkeep import CONTROL_CALLS


class ActorCalls:
    """`ReplicaCalls` over the replicas' actor handles (`handles`: the Router's, by id)."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles

    async def pause(self, replica_id: str, mode: str) -> None:
        await _result(self._handle(replica_id).pause.remote(mode))

    async def resume(self, replica_id: str) -> None:
        await _result(self._handle(replica_id).resume.remote())

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict]) -> None:
        await _result(self._handle(replica_id).begin_weight_update.remote(spec_dicts))

    async def load_weight_bucket(self, replica_id: str, bucket: Any) -> int:
        return await _result(self._handle(replica_id).load_weight_bucket.remote(bucket))

    async def finish_weight_update(self, replica_id: str, version: int) -> int:
        return await _result(self._handle(replica_id).finish_weight_update.remote(version))

    async def abort(self, replica_id: str, request_ids: list[str] | None) -> list:
        return await _result(self._handle(replica_id).abort.remote(request_ids))

    async def flush_cache(self, replica_id: str) -> None:
        await _result(self._handle(replica_id).flush_cache.remote())

    async def call(self, replica_id: str, method: str, *args: Any) -> Any:
        return await _result(self._handle(replica_id).control_call.remote(method, *args))

    def _handle(self, replica_id: str) -> Any:
        handle = self.handles.get(replica_id)
        if handle is None:
            raise RuntimeError(f"engine replica {replica_id} is gone")
        return handle


async def _result(ref: Any) -> Any:
    try:
        return await ref
    except Exception as e:
        raise unwrapped(e) from None


def unwrapped(error: Exception) -> Exception:
    """What a replica raised on purpose, as itself (Ray wraps it); other errors as they are."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    if isinstance(cause, EnginePaused):
        return EnginePaused(str(cause))
    if isinstance(cause, RequestFailed):
        return RequestFailed(str(cause))
    return error


class EngineCalls:
    """`ReplicaCalls` over one in-process `AsyncLLMEngine`, with `EngineReplica`'s methods."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def pause(self, replica_id: str, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self, replica_id: str) -> None:
        await self.engine.resume()

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict]) -> None:
        from raylane.actors.models.weights import TensorSpec

        self.engine.begin_weight_update([TensorSpec.from_dict(d) for d in spec_dicts])

    async def load_weight_bucket(self, replica_id: str, bucket: bytes) -> int:
        return self.engine.load_weight_bucket(bucket)

    async def finish_weight_update(self, replica_id: str, version: int) -> int:
        return self.engine.finish_weight_update(version)

    async def abort(self, replica_id: str, request_ids: list[str] | None) -> list:
        return await self.engine.abort(request_ids)

    async def flush_cache(self, replica_id: str) -> None:
        self.engine.flush_cache()

    async def call(self, replica_id: str, method: str, *args: Any) -> Any:
        if method not in CONTROL_CALLS:
            raise ValueError(f"method: {method!r} is not one of {sorted(CONTROL_CALLS)}")
        return getattr(self.engine, method)(*args)


class EngineTable:
    """`ReplicaTable` of one in-process engine: always reachable, at the engine's version."""

    REPLICA_ID = "local"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def reachable(self) -> list[str]:
        return [self.REPLICA_ID]

    def weight_version(self) -> int:
        return self.engine.weight_version

    def set_version(self, replica_id: str, version: int) -> None:
        pass  # the engine's own version is the truth

    def report_failure(self, replica_id: str) -> None:
        pass  # its health is `check_health`'s business
