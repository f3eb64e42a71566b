"""Sleep and weight checks of one engine, over every rank (`ModelRunner` methods of
runner/weight_checks.py): what the trainer protocols' /sleep, /wake_up and weight checkers ask.
The caller (`AsyncLLMEngine`) drains the step in flight first; sleeping needs no request left."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.executor.base import Executor

# what the control plane may call on a replica by name (`EngineReplica.control_call`): each an
# `AsyncLLMEngine` method, so an in-process engine answers the same calls
CONTROL_CALLS = frozenset({"sleep", "wake_up", "is_sleeping", "weight_checksums", "reset_weights"})


class EngineUpkeep:
    def __init__(self, executor: Executor, block_manager: BlockManager) -> None:
        self.executor = executor
        self.block_manager = block_manager
        self.sleeping = False

    def sleep(self) -> None:
        """Free every rank's KV cache (the block table stays; the prefix cache is forgotten)."""
        if not self.sleeping:
            self.block_manager.reset_prefix_cache()
            self.executor.collective_rpc("release_kv_cache")
            self.sleeping = True

    def wake_up(self) -> None:
        """Allocate the KV cache again (zeroed), with as many blocks as before."""
        if self.sleeping:
            self.executor.collective_rpc("restore_kv_cache")
            self.sleeping = False

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
