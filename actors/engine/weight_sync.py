"""`WeightSync`: an engine's side of a weight update (RL), as one transaction between steps.

begin: the manifest (HF names, full shapes, dtypes) is checked on every rank, nothing changes;
load: each bucket is checked against the manifest before a byte of it is copied into the ranks;
finish: the ranks rebuild what derives from the weights, and the engine switches to the new
version (new prefills root their prefix-cache chains at it, new tokens carry it). Between the
first bucket and finish the weights are neither old nor new: `is_open`, and nothing may step.
"""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.executor.base import Executor
from raylane.actors.models.weights import Payload, TensorSpec, WeightUpdate, bucket_specs


class WeightSync:
    def __init__(self, executor: Executor, block_manager: BlockManager) -> None:
        self.executor = executor
        self.block_manager = block_manager
        self.version = 0
        self._update: WeightUpdate | None = None

    @property
    def is_open(self) -> bool:
        """A begun update is not finished and some bucket went in (do not step)."""
        return self._update is not None and self._update.dirty

    def begin(self, specs: list[TensorSpec]) -> None:
        """ValueError naming the first tensor that would not load on some rank; a second
        begin replaces an unfinished update."""
        self.executor.collective_rpc(
            "check_weight_update", [(s.name, s.shape, s.dtype) for s in specs]
        )
        self._update = WeightUpdate({s.name: s for s in specs})

    def load(self, bucket: Payload | dict[str, Any]) -> int:
        """Apply one bucket; returns how many tensors it held."""
        update = self._require()
        specs = (
            [TensorSpec.of(name, t) for name, t in bucket.items()]
            if isinstance(bucket, dict)
            else bucket_specs(bucket)
        )
        update.check(specs)
        update.dirty = True  # from here on, the weights are neither old nor new until finish
        self.executor.load_weight_bucket(bucket)
        update.loaded.update(s.name for s in specs)
        return len(specs)

    def finish(self, version: int | None = None) -> int:
        """Switch to `version` (default: the next; must be newer); returns it."""
        self._require()
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"version: {version} is not newer than the current {self.version}")
        self.executor.collective_rpc("finish_weight_update")
        self._update = None
        self.version = self.block_manager.version = version
        return version

    def _require(self) -> WeightUpdate:
        if self._update is None:
            raise RuntimeError("no weight update is open: call begin_weight_update first")
        return self._update


def too_stale(request, version: int) -> bool:
    """Would the request's tokens span more than its `max_weight_lag` versions at `version`?"""
    lag = request.params.max_weight_lag
    if lag is None:
        return False
    firsts = [s.weight_versions[0] for s in request.seqs if s.weight_versions]
    return bool(firsts) and version - min(firsts) > lag
