"""How the control plane reaches engine replicas: Serve replicas through the deployment handle,
or one in-process engine (`LocalBackend`), behind the same `ReplicaCalls` / `ReplicaTable`."""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.errors import EnginePaused, RequestFailed


class HandleCalls:
    """`ReplicaCalls` over the engine deployment's DeploymentHandle: each call carries
    `target_replica`, which the deployment's request router (`router/serve_router.py`)
    delivers to that replica."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def __call__(self, replica_id: str, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args, target_replica=replica_id)
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

    async def __call__(self, replica_id: str, method: str, *args: Any) -> Any:
        return await getattr(self, "_" + method)(*args)

    async def _pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def _resume(self) -> None:
        await self.engine.resume()

    async def _begin_weight_update(self, spec_dicts: list[dict]) -> None:
        from raylane.actors.models.weights import TensorSpec

        self.engine.begin_weight_update([TensorSpec.from_dict(d) for d in spec_dicts])

    async def _load_weight_bucket(self, bucket: bytes) -> int:
        return self.engine.load_weight_bucket(bucket)

    async def _finish_weight_update(self, version: int) -> int:
        return self.engine.finish_weight_update(version)

    async def _abort(self, request_ids: list[str]) -> list:
        return await self.engine.abort(request_ids)

    async def _flush_cache(self) -> None:
        self.engine.flush_cache()


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
