"""How the control plane reaches engine replicas: the Router's replica actors through their
handles, or one in-process engine (`LocalBackend`), behind the same `ReplicaCalls` /
`ReplicaTable`."""

from __future__ import annotations

from typing import Any

import raylane.actors.engine.weight_transfer as weight_transfer
from raylane.actors.engine.errors import EnginePaused, RequestFailed, WeightTransferFailed
from raylane.actors.engine.upkeep import CONTROL_CALLS


class ActorCalls:
    """`ReplicaCalls` over the replicas' actor handles (`handles`: the Router's, by id)."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles

    async def pause(self, replica_id: str, mode: str) -> None:
        await _result(self._handle(replica_id).pause.remote(mode))

    async def resume(self, replica_id: str) -> None:
        await _result(self._handle(replica_id).resume.remote())

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict] | None) -> None:
        await _result(self._handle(replica_id).begin_weight_update.remote(spec_dicts))

    async def load_weight_bucket(self, replica_id: str, bucket: Any) -> int:
        return await _result(self._handle(replica_id).load_weight_bucket.remote(bucket))

    async def finish_weight_update(self, replica_id: str, version: int) -> int:
        return await _result(self._handle(replica_id).finish_weight_update.remote(version))

    async def weight_ranks(self, replica_id: str) -> int:
        return await _result(self._handle(replica_id).weight_ranks.remote())

    async def join_weight_group(self, replica_id: str, info: dict, rank_base: int) -> int:
        return await _result(self._handle(replica_id).join_weight_group.remote(info, rank_base))

    async def check_weight_receive(self, replica_id: str, spec_dicts: list[dict]) -> None:
        await _result(self._handle(replica_id).check_weight_receive.remote(spec_dicts))

    async def receive_weights(
        self, replica_id: str, group_name: str, spec_dicts: list[dict], packing: dict
    ) -> int:
        handle = self._handle(replica_id)
        return await _result(handle.receive_weights.remote(group_name, spec_dicts, packing))

    async def abort_weight_update(self, replica_id: str) -> None:
        await _result(self._handle(replica_id).abort_weight_update.remote())

    async def leave_weight_group(self, replica_id: str, group_name: str | None) -> None:
        await _result(self._handle(replica_id).leave_weight_group.remote(group_name))

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
    if isinstance(cause, WeightTransferFailed):
        return WeightTransferFailed(str(cause))
    return error


class EngineCalls:
    """`ReplicaCalls` over one in-process `AsyncLLMEngine`, with `EngineReplica`'s methods."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def pause(self, replica_id: str, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self, replica_id: str) -> None:
        await self.engine.resume()

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict] | None) -> None:
        from raylane.actors.models.weights import TensorSpec

        specs = None if spec_dicts is None else [TensorSpec.from_dict(d) for d in spec_dicts]
        self.engine.begin_weight_update(specs)

    async def load_weight_bucket(self, replica_id: str, bucket: bytes) -> int:
        return self.engine.load_weight_bucket(bucket)

    async def finish_weight_update(self, replica_id: str, version: int) -> int:
        return self.engine.finish_weight_update(version)

    async def weight_ranks(self, replica_id: str) -> int:
        return weight_transfer.num_ranks(self.engine)

    async def join_weight_group(self, replica_id: str, info: dict, rank_base: int) -> int:
        return await weight_transfer.join_group(self.engine, info, rank_base)

    async def check_weight_receive(self, replica_id: str, spec_dicts: list[dict]) -> None:
        weight_transfer.check_receive(self.engine, spec_dicts)

    async def receive_weights(
        self, replica_id: str, group_name: str, spec_dicts: list[dict], packing: dict
    ) -> int:
        return await weight_transfer.receive(self.engine, group_name, spec_dicts, **packing)

    async def abort_weight_update(self, replica_id: str) -> None:
        weight_transfer.abort_update(self.engine)

    async def leave_weight_group(self, replica_id: str, group_name: str | None) -> None:
        weight_transfer.leave_group(self.engine, group_name)

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
