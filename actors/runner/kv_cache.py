"""The paged KV cache tensors of one rank, plus the per-slot replay records: routed experts
(MoE) and the indexer's top-k positions (DSA)."""

from __future__ import annotations

import math

import numpy as np
import torch
from raylane.actors.engine.layer_kinds import KVGroups, kv_groups
from raylane.actors.runner.config import RunnerConfig


class KVCache:
    """K/V per attention layer as [num_slots, num_kv_heads, head_dim]; slot = block * size + off.

    For MoE models with routing capture, `routing[slot]` holds the experts that the token in that
    slot was routed to ([num_moe_layers, top_k]), so a prefix-cache hit returns the routing of
    the computation that filled the block. `indexer[slot]` likewise holds the positions a DSA
    model's indexer chose for that token ([num_dsa_layers, index_topk]).

    A model whose layers form several KV cache groups (`groups`, layer_kinds.KVGroups) gives
    layer `j` of every group the same tensors: a block id belongs to one group at a time, so a
    block costs one group's layers, and each layer learns its group (`kv_group`) to read that
    group's block tables.

    One block more than `num_blocks` is allocated: the scratch block, never handed out, where
    the padding rows of a graph-replayed batch write their K/V and read their context.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layers,
        routing: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        groups: KVGroups | None = None,
    ):
        self.num_blocks = num_blocks
        self.groups = groups or kv_groups([None] * len(layers))
        self.block_size = block_size
        self.routing = routing
        self.indexer: torch.Tensor | None = None  # [num_slots, dsa_layers, index_topk] int32
        self.scratch_block = num_blocks
        num_slots = (num_blocks + 1) * block_size
        shared: dict[int, list[torch.Tensor]] = {}  # index in its group -> tensors
        for layer, (group, index) in zip(layers, self.groups.layer_groups):
            if index not in shared:
                # zeros, not empty: padded gathers read unused slots and 0 * nan would poison
                shared[index] = [
                    torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                    for shape in layer.cache_shapes()
                ]
            layer.attach_cache(shared[index])
            layer.kv_group = group

    @classmethod
    def allocate(
        cls,
        config: RunnerConfig,
        layers,
        model,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        reserved: int = 0,
        shared_bytes_per_token: int = 0,
        groups: KVGroups | None = None,
    ) -> KVCache:
        """`num_blocks`: that many (a KV cache restored after sleep); None: from the config,
        `kv_cache_memory_gb` less `reserved` bytes (linear-attention state slots), each block
        paying for `shared_bytes_per_token` more (a draft model's pool of the same blocks)."""
        per_token = bytes_per_token(layers, dtype, groups) + shared_bytes_per_token
        bytes_per_block = per_token * config.block_size
        budget = int(config.kv_cache_memory_gb * 2**30) - reserved
        num_blocks = num_blocks or (config.num_kv_blocks or max(1, budget // bytes_per_block))
        routing = None
        slots = (num_blocks + 1) * config.block_size
        if config.enable_return_routed_experts:
            shape = (slots, model.num_moe_layers, model.moe_top_k)
            routing = torch.zeros(shape, dtype=torch.int32, device=device)
        cache = cls(num_blocks, config.block_size, layers, routing, dtype, device, groups)
        dsa_layers: int = getattr(model, "num_dsa_layers", 0)
        if config.enable_return_indexer_topk and dsa_layers:
            shape = (slots, dsa_layers, model.index_topk)
            cache.indexer = torch.full(shape, -1, dtype=torch.int32, device=device)
        return cache

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    def store_routing(self, slot_mapping: torch.Tensor, routed: torch.Tensor) -> None:
        """Record a step's routing on the device (no host sync inside the step)."""
        if self.routing is not None:
            # routed [T, num_moe_layers, top_k]
            self.routing[slot_mapping] = routed.to(torch.int32)

    def store_indexer(self, slot_mapping: torch.Tensor, chosen: torch.Tensor) -> None:
        """Record a step's indexer top-k on the device; chosen [T, dsa_layers, index_topk]."""
        if self.indexer is not None:
            self.indexer[slot_mapping] = chosen

    def read_routing(self, spans: list[tuple[list[int], int, int]]) -> list[np.ndarray]:
        """Routing of positions [start, end) of each (block table, start, end), copied to the
        host in one transfer after the step: [end - start, layers, k] int32 each."""
        if self.routing is None:
            raise ValueError(
                "routed experts: this KV cache records none (enable_return_routed_experts)"
            )
        return self._read(self.routing, spans)

    def read_indexer(self, spans: list[tuple[list[int], int, int]]) -> list[np.ndarray]:
        """Like read_routing, for the indexer's top-k: [end - start, dsa_layers, topk] each."""
        if self.indexer is None:
            raise ValueError("indexer top-k: this KV cache records none")
        return self._read(self.indexer, spans)

    def _read(
        self, record: torch.Tensor, spans: list[tuple[list[int], int, int]]
    ) -> list[np.ndarray]:
        slots = [_slots(table, start, end, self.block_size) for table, start, end in spans]
        flat = torch.from_numpy(np.concatenate(slots)).to(record.device)
        rows = record.index_select(0, flat).cpu().numpy()
        return np.split(rows, np.cumsum([len(s) for s in slots])[:-1])


def bytes_per_token(layers, dtype: torch.dtype, groups: KVGroups | None = None) -> int:
    """KV cache bytes one token of a block takes on this rank, over the cache tensors: every
    layer's, or with KV cache groups one group's (group 0 is a whole one)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    if groups is not None:
        layers = [layer for layer, (g, _) in zip(layers, groups.layer_groups) if g == 0]
    return itemsize * sum(math.prod(s) for layer in layers for s in layer.cache_shapes())


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    positions = np.arange(start, end)
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
