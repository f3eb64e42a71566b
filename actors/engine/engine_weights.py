"""`EngineWeights`: the offline engine's weight verbs (a whole load, and RL's update
transaction: check, buckets, finish), between steps. `LLMEngine` inherits them; they drive its
`WeightSync`, its pipeline and its postprocessor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from raylane.actors.models.weights import (
    DEFAULT_BUCKET_BYTES,
    Payload,
    TensorSpec,
    iter_buckets,
    specs_of,
)

if TYPE_CHECKING:
    import torch
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.engine.postprocessor import Postprocessor
    from raylane.actors.engine.step_pipeline import StepPipeline
    from raylane.actors.engine.weight_sync import WeightSync
    from raylane.actors.executor.base import Executor


class EngineWeights:
    # set by LLMEngine.__init__
    executor: Executor
    block_manager: BlockManager
    pipeline: StepPipeline
    post: Postprocessor
    weights: WeightSync

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Load HF-named (full, unsharded) tensors into every rank, then drop the prefix cache,
        whose blocks were computed with the old weights. Call between steps."""
        self.pipeline.quiesce()
        self.executor.load_weights(weights)
        self.block_manager.reset_prefix_cache()

    # --- weight updates (RL): check, buckets, finish; between steps --------------------------

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> int:
        """A whole update in one call (offline use): check every name and shape on every rank,
        load bounded buckets, switch to `version` (default: the next); returns it. Requests it
        ends as "stale" (`SamplingParams.max_weight_lag`) report it from the next step."""
        weights = list(weights)
        self.begin_weight_update(specs_of(weights))
        for bucket in iter_buckets(weights, bucket_bytes):
            self.load_weight_bucket(dict(bucket))
        return self.finish_weight_update(version)

    def begin_weight_update(self, specs: list[TensorSpec] | None) -> None:
        """Check an update's manifest on every rank (ValueError naming the first tensor that
        would not load); no weight changes. A second begin replaces an unfinished update."""
        self.pipeline.quiesce()
        self.weights.begin(specs)

    def load_weight_bucket(self, bucket: Payload | dict[str, torch.Tensor]) -> int:
        """Apply one bucket (safetensors bytes, or a uint8 array of them, or named tensors) of
        the begun update; each tensor must be in its manifest, with that shape and dtype
        (checked before any copy)."""
        return self.weights.load(bucket)

    def finish_weight_update(self, version: int | None = None) -> int:
        """Switch to the new weights as `version` (default: the next; must be newer); returns
        it. Requests this ends as "stale" report it from the next step (or `drain`)."""
        version = self.weights.finish(version)
        self.pipeline.hold(self.post.end_stale())
        return version

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def weight_update_open(self) -> bool:
        """A begun update is not finished: its buckets may be half in (do not step)."""
        return self.weights.is_open
