"""`WeightSync`: an engine's side of a weight update (RL), as one transaction between steps.

begin: the manifest (HF names, full shapes, dtypes) is checked on every rank, nothing changes
(an open-ended update, begun with no manifest, checks each receive's tensors instead);
load: each bucket is checked against the manifest before a byte of it is copied into the ranks;
receive: tensors the trainer broadcasts over its collective group (`join_group`), checked on
every rank first (`check_receive`, which the control plane runs on every replica before any
replica receives);
finish: the engine switches to the new version (new prefills root their prefix-cache chains at
it, new tokens carry it); abort: every rank puts its old weights back (the ranks save what an
update overwrites). Between the first load and finish/abort the weights are neither old nor
new: `is_open`, and nothing may step.

A draft model's tensors (`draft.<name>`) ride in the same transaction: the ranks hold the
draft (runner/draft_runner.py) and route them (`RunnerWeights`), so buckets and the trainer's
group reach them, and the draft and the target always hold weights of one version.
"""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.errors import WeightTransferFailed
from raylane.actors.executor.base import Executor
from raylane.actors.models.weights import (
    Payload,
    TensorSpec,
    WeightUpdate,
    bucket_specs,
)


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

    @property
    def has_update(self) -> bool:
        return self._update is not None

    def begin(self, specs: list[TensorSpec] | None) -> None:
        """ValueError naming the first tensor that would not load on some rank; a second
        begin replaces an unfinished update. `specs` None: an open-ended update."""
        self.executor.collective_rpc("weights.check", _triples(specs or []))
        self._update = WeightUpdate({s.name: s for s in specs or []}, open_ended=specs is None)

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

    def check_receive(self, specs: list[TensorSpec]) -> None:
        """ValueError unless these tensors are the update's (an open-ended one takes any that
        load) and load on every rank; nothing changes."""
        update = self._require()
        if update.open_ended:
            self.executor.collective_rpc("weights.check", _triples(specs), begin=False)
            update.manifest.update({s.name: s for s in specs})
        update.check(specs)

    def receive(self, group_name: str, specs: list[TensorSpec], packed: bool, buffer: int) -> int:
        """Receive checked tensors from the trainer's group into every rank; on any failure
        every rank rolls back and leaves its groups (WeightTransferFailed)."""
        update = self._require()
        update.check(specs)
        update.dirty = True
        try:
            self.executor.collective_rpc(
                "weights.receive", group_name, _triples(specs), packed, buffer
            )
        except Exception as e:
            self.abort()
            self.executor.collective_rpc("weights.close_group")
            raise WeightTransferFailed(f"receiving over {group_name!r} failed: {e}") from e
        update.loaded.update(s.name for s in specs)
        return len(specs)

    def abort(self) -> None:
        """Drop the open update; every rank puts back the weights it overwrote."""
        self.executor.collective_rpc("weights.rollback")
        self._update = None

    def finish(self, version: int | None = None) -> int:
        """Switch to `version` (default: the next; must be newer); returns it."""
        self._require()
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"version: {version} is not newer than the current {self.version}")
        self.executor.collective_rpc("weights.finish")
        self._update = None
        self.version = self.block_manager.version = version
        return version

    def _require(self) -> WeightUpdate:
        if self._update is None:
            raise RuntimeError("no weight update is open: call begin_weight_update first")
        return self._update


def _triples(specs: list[TensorSpec]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(s.name, s.shape, s.dtype) for s in specs]


def too_stale(request, version: int) -> bool:
    """Would the request's tokens span more than its `max_weight_lag` versions at `version`?"""
    lag = request.params.max_weight_lag
    if lag is None:
        return False
    firsts = [s.weight_versions[0] for s in request.seqs if s.weight_versions]
    return bool(firsts) and version - min(firsts) > lag
