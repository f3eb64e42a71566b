"""`RunnerUpkeep`: what a rank does besides running steps, on the trainer protocols' calls: a
checksum of its weights, overwriting them with seeded noise, and sleeping (the KV cache freed,
at level 2 the weights spilled to disk) and waking up; and the KV cache and the CUDA graphs,
made at start-up and again at each wake-up (runner/weight_checks.py, runner/weight_spill.py).

A part of `ModelRunner` (its base class), reached by the same names: `collective_rpc(
"release_kv_cache")` calls it on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.engine.layer_kinds import KVGroups
from raylane.actors.runner import weight_checks
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.features.feature_set import RunnerFeatures
from raylane.actors.runner.features.linear_state import LinearState
from raylane.actors.runner.graph_runner import GraphRunner
from raylane.actors.runner.kv_cache import KVCache
from raylane.actors.runner.weight_spill import WeightSpill
from raylane.actors.runner.weight_updates import RunnerWeights


class RunnerUpkeep:
    """`ModelRunner`'s KV cache allocation, weight checks, sleep and wake-up, and graph
    capture; the features hear of each (`on_sleep`, `on_wake`, `on_weights`)."""

    config: RunnerConfig
    model: Any
    dtype: torch.dtype
    device: torch.device
    weights: RunnerWeights
    features: RunnerFeatures
    nets: list[Any]  # the target, then the networks features run beside it (a draft model)
    spills: list[WeightSpill]  # each net's weights in a level-2 sleep
    kv: KVCache
    kv_groups: KVGroups
    graphs: GraphRunner | None

    def _allocate_kv(self, num_blocks: int | None = None) -> None:
        """`num_blocks` blocks, or (None) as many as the budget holds less what the features
        reserve, each block paying for the features' pools over the same block ids too."""
        self.kv = KVCache.allocate(
            self.config,
            self.model.attention_layers(),
            self.model,
            self.dtype,
            self.device,
            num_blocks,
            reserved=self.features.kv_reserved_bytes(),
            shared_bytes_per_token=self.features.kv_bytes_per_token(),
            groups=self.kv_groups,
        )
        self.features.kv_allocated(self.kv.num_blocks)

    def _graph_runner(self, config: RunnerConfig) -> GraphRunner | None:
        eager = config.enforce_eager
        if eager is None:
            eager = self.device.type != "cuda"
        if eager or not self.features.allows_graph_replay():
            return None
        linear = self.features.find(LinearState)  # padding rows take its scratch slot
        graphs = GraphRunner(
            self.model,
            self.kv,
            config.cudagraph_capture_sizes,
            config.max_model_len,
            self.device,
            linear.cache if linear is not None else None,
            width=self._verify_width(config),
        )
        if self.device.type == "cuda":
            graphs.capture()
        return graphs

    def _verify_width(self, config: RunnerConfig) -> int:
        """Query tokens per row of the verify graphs (1 + k), or 1 for none: not where a
        verify row needs host-side work in its forward (a feature says so: a linear-attention
        state's verify records, a DSA indexer's per-token selections), nor under the torch
        backend, whose prefill path plans on the host."""
        if not self.features.allows_verify_graphs() or not config.num_speculative_tokens:
            return 1
        backend = self.model.attention_layers()[0].backend.name
        return 1 if backend == "torch" else 1 + config.num_speculative_tokens

    # --- weight checks and sleep (the trainer protocols; runner/weight_checks.py) -------------

    def weight_checksums(self) -> dict[str, str]:
        sums = weight_checks.weight_checksums(self.model)
        return sums | self.features.weight_checksums()

    def reset_weights(self, seed: int) -> None:
        self.weights.settle()  # the last commit's re-pack first
        weight_checks.reset_weights(self.model, seed)
        self.features.on_weights()

    def release_kv_cache(self) -> None:
        """Free the KV cache (and the routing record); `restore_kv_cache` brings it back."""
        layers = [layer for net in self.nets for layer in net.attention_layers()]
        weight_checks.release_kv_cache(layers, self.dtype, self.device)
        self.kv.routing, self.graphs = None, None  # the graphs captured the old tensors
        self.features.on_sleep(1)

    def release_weights(self) -> None:
        """Level-2 sleep: the weights spilled to a file and their memory freed."""
        self.weights.settle()  # the last commit's re-pack first
        for net, spill in zip(self.nets, self.spills):
            spill.release(net)
        self.graphs = None  # the graphs captured the old tensors
        self.features.on_sleep(2)

    def restore_weights(self) -> None:
        """The spilled weights back (before the KV cache, whose restore captures graphs)."""
        for net, spill in zip(self.nets, self.spills):
            spill.restore(net)

    def restore_kv_cache(self) -> None:
        """A zeroed KV cache of the same number of blocks (the engine's block table is kept)."""
        self._allocate_kv(self.kv.num_blocks)
        self.graphs = self._graph_runner(self.config)
        self.features.on_wake()
