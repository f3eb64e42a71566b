"""One engine replica's control verbs, over its `AsyncLLMEngine`: what the control plane
(router/control.py) calls on every replica. `EngineReplica`, the Ray actor, is one; the
in-process backend holds one directly. Either way a verb is these methods, spelled once.

Imports no torch (the Router, which only calls these through actor handles, reads the names).
"""

from __future__ import annotations

from typing import Any

import raylane.actors.engine.weight_transfer as weight_transfer
from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.upkeep import CONTROL_CALLS
from raylane.actors.replica_lora import ReplicaLoRA


class ReplicaControl(ReplicaLoRA):
    """The verbs; the adapter verbs are `ReplicaLoRA`'s (actors/replica_lora.py)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # an AsyncLLMEngine

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def weight_version(self) -> int:
        return self.engine.weight_version

    async def begin_weight_update(self, specs: list[dict] | None) -> None:
        from raylane.actors.models.weights import TensorSpec

        self.engine.begin_weight_update(
            None if specs is None else [TensorSpec.from_dict(d) for d in specs]
        )

    async def load_weight_bucket(self, bucket: Any) -> int:
        """`bucket`: safetensors bytes, or `[ObjectRef]` of them (stored once for every
        replica; the list keeps callers in between from fetching it)."""
        if isinstance(bucket, list):
            bucket = await bucket[0]
        return self.engine.load_weight_bucket(bucket)

    async def finish_weight_update(self, version: int | None = None) -> int:
        return self.engine.finish_weight_update(version)

    # the trainer's collective group (actors/engine/weight_transfer.py)

    async def weight_ranks(self) -> int:
        return weight_transfer.num_ranks(self.engine)

    async def join_weight_group(self, info: dict, rank_base: int) -> int:
        return await weight_transfer.join_group(self.engine, info, rank_base)

    async def check_weight_receive(self, specs: list[dict]) -> None:
        weight_transfer.check_receive(self.engine, specs)

    async def receive_weights(self, group_name: str, specs: list[dict], packing: dict) -> int:
        return await weight_transfer.receive(self.engine, group_name, specs, **packing)

    async def abort_weight_update(self) -> None:
        weight_transfer.abort_update(self.engine)

    async def leave_weight_group(self, group_name: str | None) -> None:
        weight_transfer.leave_group(self.engine, group_name)

    # requests, the cache, and the engine's upkeep

    async def abort(self, request_ids: list[str] | None) -> list[RequestOutput]:
        return await self.engine.abort(request_ids)

    async def flush_cache(self) -> None:
        self.engine.flush_cache()

    async def control_call(self, method: str, *args: Any) -> Any:
        """One of the engine's `CONTROL_CALLS` (sleep, wake_up, weight checks)."""
        if method not in CONTROL_CALLS:
            raise ValueError(f"method: {method!r} is not one of {sorted(CONTROL_CALLS)}")
        return getattr(self.engine, method)(*args)
