"""Sleep and weight checks of one engine, over every rank (`ModelRunner` methods of
runner/weight_checks.py): what the trainer protocols' /sleep, /wake_up and weight checkers ask.
The caller (`AsyncLLMEngine`) drains the step in flight first; sleeping needs no request left."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.executor.base import Executor

# what the control plane may call on a replica by name (`ReplicaControl.control_call`): each an
# `AsyncLLMEngine` method, so an in-process engine answers the same calls
CONTROL_CALLS = frozenset({"sleep", "wake_up", "is_sleeping", "weight_checksums", "reset_weights"})


class EngineUpkeep:
    def __init__(self, executor: Executor, block_manager: BlockManager) -> None:
        self.executor = executor
        self.block_manager = block_manager
        self.kv_released = False
        self.weights_released = False

    @property
    def sleeping(self) -> bool:
        return self.kv_released or self.weights_released

    def sleep(self, level: int = 1) -> None:
        """Free every rank's KV cache (the block table stays; the prefix cache is forgotten);
        level 2 releases the weights too (spilled to local disk, `WeightSpill`)."""
        if not self.kv_released:
            self.block_manager.reset_prefix_cache()
            self.executor.collective_rpc("release_kv_cache")
            self.kv_released = True
        if level == 2 and not self.weights_released:
            self.executor.collective_rpc("release_weights")
            self.weights_released = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the weights ("weights" among `tags`, or no tags) and then allocate the KV
        cache again, zeroed, with as many blocks as before ("kv_cache", or no tags)."""
        weights = tags is None or "weights" in tags
        kv = tags is None or "kv_cache" in tags
        if kv and self.weights_released and not weights:
            raise ValueError("tags: the weights sleep too (level 2); wake them with the KV cache")
        if weights and self.weights_released:
            self.executor.collective_rpc("restore_weights")
            self.weights_released = False
        if kv and self.kv_released:
            self.executor.collective_rpc("restore_kv_cache")
            self.kv_released = False

    def weight_checksums(self) -> dict[str, str]:
        """sha256 per parameter, over every rank's slice."""
        return combine_checksums(self.executor.collective_rpc("weight_checksums"))

    def reset_weights(self, seed: int) -> None:
        """Seeded noise into every parameter; cached prefixes are forgotten (stale KV)."""
        self.executor.collective_rpc("reset_weights", seed)
        self.block_manager.reset_prefix_cache()


def combine_checksums(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """One checksum per parameter over every rank's slice (a rank's own when there is one)."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    return {
        name: hashlib.sha256("".join(rank[name] for rank in per_rank).encode()).hexdigest()
        for name in per_rank[0]
    }
