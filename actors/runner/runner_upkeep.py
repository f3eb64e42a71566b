"""`RunnerUpkeep`: what a rank does besides running steps, on the trainer protocols' calls: a
checksum of its weights, overwriting them with seeded noise, and sleeping (the KV cache freed,
at level 2 the weights spilled to disk) and waking up; and the CUDA graphs, captured over the
KV cache at start-up and again at each wake-up (runner/weight_checks.py, runner/weight_spill.py).

A part of `ModelRunner` (its base class), reached by the same names: `collective_rpc(
"release_kv_cache")` calls it on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.engine.layer_kinds import KVGroups
from raylane.actors.runner import weight_checks
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.draft_runner import DraftRunner
from raylane.actors.runner.graph_runner import GraphRunner
from raylane.actors.runner.kv_cache import KVCache
from raylane.actors.runner.state_cache import StateCache
from raylane.actors.runner.weight_spill import WeightSpill
from raylane.actors.runner.weight_updates import RunnerWeights


class RunnerUpkeep:
    """`ModelRunner`'s weight checks, sleep and wake-up, and graph capture."""

    config: RunnerConfig
    model: Any
    dtype: torch.dtype
    device: torch.device
    weights: RunnerWeights
    spill: WeightSpill
    draft: DraftRunner | None
    state: StateCache | None
    kv: KVCache
    kv_groups: KVGroups
    graphs: GraphRunner | None

    def _graph_runner(self, config: RunnerConfig) -> GraphRunner | None:
        eager = config.enforce_eager
        if eager is None:
            eager = self.device.type != "cuda"
        if eager:
            return None
        graphs = GraphRunner(
            self.model,
            self.kv,
            config.cudagraph_capture_sizes,
            config.max_model_len,
            self.device,
            self.state,
            width=self._verify_width(config),
        )
        if self.device.type == "cuda":
            graphs.capture()
        return graphs

    def _verify_width(self, config: RunnerConfig) -> int:
        """Query tokens per row of the verify graphs (1 + k), or 1 for none: not where a
        verify row needs host-side work in its forward (a linear-attention state's verify
        records, a DSA indexer's per-token selections), nor under the torch backend, whose
        prefill path plans on the host (MTP steps never replay: they need hidden states)."""
        host_work = self.state is not None or self.kv.indexer is not None or config.mtp
        if host_work or not config.num_speculative_tokens:
            return 1
        backend = self.model.attention_layers()[0].backend.name
        return 1 if backend == "torch" else 1 + config.num_speculative_tokens

    # --- weight checks and sleep (the trainer protocols; runner/weight_checks.py) -------------

    def weight_checksums(self) -> dict[str, str]:
        sums = weight_checks.weight_checksums(self.model)
        return sums | (self.draft.checksums() if self.draft is not None else {})

    def reset_weights(self, seed: int) -> None:
        self.weights.settle()  # the last commit's re-pack first
        weight_checks.reset_weights(self.model, seed)

    def release_kv_cache(self) -> None:
        """Free the KV cache (and the routing record); `restore_kv_cache` brings it back."""
        draft = self.draft.layers() if self.draft is not None else []
        layers = [*self.model.attention_layers(), *draft]
        weight_checks.release_kv_cache(layers, self.dtype, self.device)
        self.kv.routing, self.graphs = None, None  # the graphs captured the old tensors

    def release_weights(self) -> None:
        """Level-2 sleep: the weights spilled to a file and their memory freed."""
        self.weights.settle()  # the last commit's re-pack first
        for model, spill in self._spills():
            spill.release(model)
        self.graphs = None  # the graphs captured the old tensors

    def restore_weights(self) -> None:
        """The spilled weights back (before the KV cache, whose restore captures graphs)."""
        for model, spill in self._spills():
            spill.restore(model)

    def _spills(self) -> list[tuple[Any, WeightSpill]]:
        draft = [(self.draft.model, self.draft.spill)] if self.draft is not None else []
        return [(self.model, self.spill), *draft]

    def restore_kv_cache(self) -> None:
        """A zeroed KV cache of the same number of blocks (the engine's block table is kept)."""
        layers = self.model.attention_layers()
        self.kv = KVCache.allocate(
            self.config,
            layers,
            self.model,
            self.dtype,
            self.device,
            self.kv.num_blocks,
            groups=self.kv_groups,
        )
        if self.draft is not None:
            self.draft.allocate(self.kv.num_blocks)
        self.graphs = self._graph_runner(self.config)
