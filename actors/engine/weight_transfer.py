"""An async engine's part in a collective weight transfer, as one replica sees it.

The calls that wait on the trainer (joining its group, receiving) run on a worker thread, so
the replica's event loop keeps answering (health checks, aborts) meanwhile; they run only
while the engine is paused with nothing stepping, so the worker is the only one touching the
executor. Joining needs no pause (vLLM's trainers join at start-up): it is quick, and runs on
the loop between steps like every other control call. `EngineReplica` and the in-process
backend both call these, so a route reaches one replica or many by the same path.
"""

from __future__ import annotations

import asyncio
from typing import Any

# vLLM's default packed buffer; actors.models.weights has it too, but importing that package
# imports torch, which the Router (a user of these calls' module) does not
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30


def _specs(spec_dicts: list[dict]) -> list:
    from raylane.actors.models.weights import TensorSpec

    return [TensorSpec.from_dict(d) for d in spec_dicts]


def num_ranks(engine: Any) -> int:
    """How many ranks this engine brings to the trainer's group (its tensor parallelism)."""
    return engine.engine.config.tensor_parallel_size


async def join_group(engine: Any, info: dict[str, Any], rank_base: int) -> int:
    """Every rank of this engine joins the trainer's group (rank `rank_base + tp rank`);
    waits, off the event loop, until the whole group is in. Returns how many ranks joined."""
    rpc = engine.engine.weights.executor.collective_rpc
    return len(await asyncio.to_thread(rpc, "weights.join_group", info, rank_base))


def leave_group(engine: Any, group_name: str | None) -> None:
    engine.engine.weights.executor.collective_rpc("weights.close_group", group_name)


def check_receive(engine: Any, spec_dicts: list[dict]) -> None:
    """ValueError unless every rank can take these tensors into the open update."""
    _require_paused(engine)
    engine.engine.weights.check_receive(_specs(spec_dicts))


async def receive(
    engine: Any,
    group_name: str,
    spec_dicts: list[dict],
    packed: bool = False,
    buffer_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
) -> int:
    """Receive the (checked) tensors into every rank; `WeightTransferFailed` rolls back."""
    _require_paused(engine)
    sync = engine.engine.weights
    return await asyncio.to_thread(
        sync.receive, group_name, _specs(spec_dicts), packed, buffer_bytes
    )


def abort_update(engine: Any) -> None:
    """Drop the open update, old weights back on every rank (no-op when none is open)."""
    if engine.engine.weights.has_update:
        engine.engine.weights.abort()


def _require_paused(engine: Any) -> None:
    if engine.paused_mode is None:
        raise RuntimeError("pause the engine before updating its weights")
