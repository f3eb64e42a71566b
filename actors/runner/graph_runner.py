"""Decode steps replayed from CUDA graphs captured at start-up, one graph per batch size.

A decode batch of n sequences is padded to the next captured size: its inputs are copied into
static buffers (ids, positions, sequence lengths, one slot mapping and block table per KV
cache group, and for linear-attention layers each row's state slot) and the graph of that size
replays the forward and the LM head into static outputs. Padding rows decode token 0 at
position 0 into the KV cache's scratch block (and the state cache's scratch slot), so they
write nowhere that matters and never need a special case in a kernel.

On the CPU nothing is captured: `replay` runs the same forward eagerly over the same static
buffers and padding, so everything but the capture itself is exercised without a GPU.
Sampling stays outside the graph (on the host-built per-row parameters), as in vLLM.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.kv_cache import KVCache
from raylane.actors.runner.state_cache import StateCache
from raylane.kernels.attention import AttentionMetadata
from raylane.kernels.linear_attention import StateMetadata

logger = logging.getLogger(__name__)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab] float32, written by every replay
    routed: torch.Tensor | None  # [size, num_moe_layers, top_k] int32


class GraphRunner:
    def __init__(
        self,
        model,
        kv: KVCache,
        sizes: tuple[int, ...],
        max_model_len: int,
        device: torch.device,
        state: StateCache | None = None,
    ):
        self.model, self.kv, self.device, self.state = model, kv, device, state
        self.sizes = tuple(sorted(sizes))
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.max_model_len = max_model_len
        self.graphs: dict[int, Captured] = {}
        self.replays = 0
        size = self.sizes[-1]
        new = lambda dtype, fill=0: torch.full((size,), fill, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = new(torch.long)
        self.positions = new(torch.long)
        groups = range(kv.groups.num_groups)
        # per KV cache group [size] and [size, max_blocks]
        self.slot_mappings = [new(torch.long, kv.scratch_slot) for _ in groups]
        self.seq_lens = new(torch.int32, 1)
        self.group_tables = [
            torch.full((size, self.max_blocks), kv.scratch_block, dtype=torch.int32, device=device)
            for _ in groups
        ]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # linear-attention layers: each row's state slot [size] int64
        self.state_slots = new(torch.long, state.scratch_slot if state is not None else 0)

    def fits(self, step: StepInputs) -> bool:
        """A pure decode batch that samples every row and fits the largest size."""
        attn = step.attn
        return (
            attn.num_prefills == 0
            and attn.num_seqs <= self.sizes[-1]
            and step.logits_indices.shape[0] == attn.num_seqs
        )

    def padded_size(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs share its memory pool.
        Call after the weights are loaded and the KV cache is allocated; a weight update
        copies into the same parameters, so the graphs stay valid."""
        pool = None
        for size in reversed(self.sizes):
            self._reset_padding(0, size)
            meta = self._metadata(size, self.max_blocks, self.max_model_len)
            for _ in range(2):  # warm-up: kernels compile and allocators settle outside capture
                self._forward(size, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    logits, routed = self._forward(size, meta)
            except RuntimeError as e:  # an op that syncs with the host cannot be captured
                # (e.g. torch._grouped_mm's fallback outside bf16 on sm90): run eager instead
                logger.warning(
                    "CUDA graph capture failed at batch %d (%s); decode batches of "
                    "this size and below replay eagerly",
                    size,
                    e,
                )
                torch.cuda.synchronize(self.device)
                return
            pool = graph.pool()
            self.graphs[size] = Captured(graph, logits, routed)

    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n, vocab] float32, routed [n, layers, k] or None) of a batch that fits."""
        attn, n = step.attn, step.attn.num_seqs
        size = self.padded_size(n)
        width = attn.block_tables.shape[1]
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.seq_lens[:n].copy_(attn.seq_lens, non_blocking=True)
        for g, group in enumerate(attn.groups or [attn]):
            self.slot_mappings[g][:n].copy_(group.slot_mapping, non_blocking=True)
            # entries past a sequence's own blocks are never read (masked by seq_lens)
            self.group_tables[g][:n, :width].copy_(group.block_tables, non_blocking=True)
        if attn.linear is not None:
            self.state_slots[:n].copy_(attn.linear.state_slots, non_blocking=True)
        self._reset_padding(n, size)
        self.replays += 1
        captured = self.graphs.get(size)
        if captured is not None:
            captured.graph.replay()
            logits, routed = captured.logits, captured.routed
        else:  # the eager "replay": same buffers and padding; context only as wide as needed
            meta = self._metadata(size, width, attn.max_seq_len)
            logits, routed = self._forward(size, meta)
        return logits[:n], None if routed is None else routed[:n]

    def _forward(self, size: int, meta: AttentionMetadata):
        hidden, routed = self.model(self.input_ids[:size], self.positions[:size], meta)
        return self.model.compute_logits(hidden), routed

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 into the scratch block."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        for slots, tables in zip(self.slot_mappings, self.group_tables):
            slots[start:end] = self.kv.scratch_slot
            tables[start:end, 0] = self.kv.scratch_block
        if self.state is not None:
            self.state_slots[start:end] = self.state.scratch_slot

    def _metadata(self, size: int, width: int, max_seq_len: int) -> AttentionMetadata:
        metas = [
            self._group_metadata(g, size, width, max_seq_len) for g in range(len(self.group_tables))
        ]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    def _group_metadata(
        self, group: int, size: int, width: int, max_seq_len: int
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mappings[group][:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables[group][:size, :width],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.kv.block_size,
            linear=None if self.state is None else self._state_metadata(size),
        )

    def _state_metadata(self, size: int) -> StateMetadata:
        """One token per row; no host lists (a decode batch plans nothing on the host)."""
        return StateMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            state_slots=self.state_slots[:size],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
        )
