"""Decode steps replayed from CUDA graphs captured at start-up, one graph per batch size.

A decode batch of n sequences is padded to the next captured size: its inputs are copied into
static buffers (ids, positions, sequence lengths, one slot mapping and block table per KV
cache group, and for linear-attention layers each row's state slot) and the graph of that size
replays the forward and the LM head into static outputs. Padding rows decode token 0 at
position 0 into the KV cache's scratch block (and the state cache's scratch slot), so they
write nowhere that matters and never need a special case in a kernel.

Speculative decoding's verify steps replay too, from graphs of `width` = 1 + k query tokens per
row: a step whose rows are all decode or verify rows of at most `width`
tokens, each with at least `width` tokens of context, is laid out row-major in a [size, width]
grid, each row's tokens at its end (dummies before them), and attends through the prefill path
of the attention backend with static shapes (`max_query_len` = width, `query_start_loc` =
width-strided; so the torch backend, whose prefill path plans on the host, runs them eagerly).
A verify graph of `size` rows holds size * width tokens: it is captured for the capture sizes
whose tokens fit the largest decode graph's buffers.

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
from raylane.actors.runner.verify_layout import grid_rows, verify_fits
from raylane.kernels.attention import AttentionMetadata
from raylane.kernels.linear_attention import StateMetadata

logger = logging.getLogger(__name__)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size * width, vocab] float32, written by every replay
    routed: torch.Tensor | None  # [size * width, num_moe_layers, top_k] int32


class GraphRunner:
    def __init__(
        self,
        model,
        kv: KVCache,
        sizes: tuple[int, ...],
        max_model_len: int,
        device: torch.device,
        state: StateCache | None = None,
        width: int = 1,
    ):
        """`width`: query tokens per row of the verify graphs (1 + k; 1: none)."""
        self.model, self.kv, self.device, self.state = model, kv, device, state
        self.sizes = tuple(sorted(sizes))
        self.width = width
        tokens = self.sizes[-1]  # the static buffers' tokens, shared by every graph
        self.verify_sizes = tuple(s for s in self.sizes if width > 1 and s * width <= tokens)
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.max_model_len = max_model_len
        self.graphs: dict[tuple[int, int], Captured] = {}  # (rows, width) -> its graph
        self.replays = 0
        new = lambda dtype, fill=0: torch.full((tokens,), fill, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = new(torch.long)
        self.positions = new(torch.long)
        groups = range(kv.groups.num_groups)
        # per KV cache group [tokens] and [rows, max_blocks]
        self.slot_mappings = [new(torch.long, kv.scratch_slot) for _ in groups]
        self.seq_lens = new(torch.int32, 1)
        self.group_tables = [
            torch.full(
                (tokens, self.max_blocks), kv.scratch_block, dtype=torch.int32, device=device
            )
            for _ in groups
        ]
        # row i's tokens start at i * width (decode: width 1)
        self.starts = {
            w: torch.arange(tokens + 1, dtype=torch.int32, device=device) * w for w in {1, width}
        }
        # linear-attention layers: each row's state slot [rows] int64
        self.state_slots = new(torch.long, state.scratch_slot if state is not None else 0)

    def fits(self, step: StepInputs) -> bool:
        """A pure decode batch that samples every row and fits the largest size."""
        attn = step.attn
        return (
            attn.num_prefills == 0
            and attn.num_seqs <= self.sizes[-1]
            and step.logits_indices.shape[0] == attn.num_seqs
        )

    def fits_verify(self, step: StepInputs, sample_rows_only: bool) -> bool:
        """A batch of decode and verify rows (`sample_rows_only`: every token samples) that a
        verify graph holds (verify_layout.verify_fits)."""
        sizes = self.verify_sizes
        return (
            sample_rows_only
            and bool(sizes)
            and step.attn.seqs is not None
            and verify_fits(step.attn.seqs, self.width, sizes[-1])
        )

    def padded_size(self, batch: int, width: int = 1) -> int:
        sizes = self.sizes if width == 1 else self.verify_sizes
        return sizes[bisect.bisect_left(sizes, batch)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs share its memory pool.
        Call after the weights are loaded and the KV cache is allocated; a weight update
        copies into the same parameters, so the graphs stay valid."""
        pool = None
        shapes = [(s, 1) for s in self.sizes] + [(s, self.width) for s in self.verify_sizes]
        for size, width in sorted(shapes, key=lambda sw: (-sw[0] * sw[1], sw[1])):
            self._pad(0, size, width)
            meta = self._metadata(size, self.max_blocks, self.max_model_len, width)
            for _ in range(2):  # warm-up: kernels compile and allocators settle outside capture
                self._forward(size * width, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    logits, routed = self._forward(size * width, meta)
            except RuntimeError as e:  # an op that syncs with the host cannot be captured
                # (e.g. torch._grouped_mm's fallback outside bf16 on sm90): run eager instead
                logger.warning(
                    "CUDA graph capture failed at batch %d x %d tokens (%s); batches of "
                    "this size and below replay eagerly",
                    size,
                    width,
                    e,
                )
                torch.cuda.synchronize(self.device)
                return
            pool = graph.pool()
            self.graphs[size, width] = Captured(graph, logits, routed)

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
        self._pad(n, size)
        logits, routed = self._replay(size, 1, width, attn.max_seq_len)
        return logits[:n], None if routed is None else routed[:n]

    def run_verify(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [len(logits_indices), vocab], routed [T, layers, k] or None) of a batch
        that `fits_verify`, in the eager layout's row order."""
        attn, n, w = step.attn, step.attn.num_seqs, self.width
        assert attn.seqs is not None
        size = self.padded_size(n, w)
        cols = attn.block_tables.shape[1]
        grid = torch.tensor(grid_rows(attn.seqs, w), dtype=torch.long, device=self.device)
        self._pad(n, size, w)
        real = slice(0, n * w)  # the real rows: dummies first, the step's tokens over them
        self.input_ids[real] = 0
        self.input_ids.index_copy_(0, grid, step.input_ids)
        self.seq_lens[:n].copy_(attn.seq_lens, non_blocking=True)
        self._grid_positions(n, w)
        for g, group in enumerate(attn.groups or [attn]):
            self.slot_mappings[g][real] = self.kv.scratch_slot
            self.slot_mappings[g].index_copy_(0, grid, group.slot_mapping)
            self.group_tables[g][:n, :cols].copy_(group.block_tables, non_blocking=True)
        logits, routed = self._replay(size, w, cols, attn.max_seq_len)
        rows = grid.index_select(0, step.logits_indices)
        return logits.index_select(0, rows), None if routed is None else routed[grid]

    def _replay(self, size: int, width: int, cols: int, max_seq_len: int):
        """Replay the (size, width) graph, or on the CPU run its forward eagerly over the same
        buffers and padding, the context only as wide as needed."""
        self.replays += 1
        captured = self.graphs.get((size, width))
        if captured is not None:
            captured.graph.replay()
            return captured.logits, captured.routed
        return self._forward(size * width, self._metadata(size, cols, max_seq_len, width))

    def _forward(self, tokens: int, meta: AttentionMetadata):
        hidden, routed = self.model(self.input_ids[:tokens], self.positions[:tokens], meta)
        return self.model.compute_logits(hidden), routed

    def _pad(self, start: int, end: int, width: int = 1) -> None:
        """Rows [start, end) take `width` tokens 0 at positions 0 .. width - 1 into the
        scratch block."""
        if start >= end:
            return
        tokens = slice(start * width, end * width)
        self.input_ids[tokens] = 0
        # positions 0 .. width - 1 in each row, its context length width
        self.positions[tokens] = torch.arange(width, device=self.device).repeat(end - start)
        self.seq_lens[start:end] = width
        for slots, tables in zip(self.slot_mappings, self.group_tables):
            slots[tokens] = self.kv.scratch_slot
            tables[start:end, 0 if width == 1 else slice(None)] = self.kv.scratch_block
        if self.state is not None:
            self.state_slots[start:end] = self.state.scratch_slot

    def _grid_positions(self, rows: int, width: int) -> None:
        """Row i's `width` tokens sit at positions seq_len_i - width .. seq_len_i - 1."""
        offsets = torch.arange(width - 1, -1, -1, device=self.device)
        grid = self.seq_lens[:rows, None].long() - 1 - offsets  # [rows, width]
        self.positions[: rows * width].copy_(grid.reshape(-1))

    def _metadata(
        self, size: int, cols: int, max_seq_len: int, width: int = 1
    ) -> AttentionMetadata:
        metas = [
            self._group_metadata(g, size, cols, max_seq_len, width)
            for g in range(len(self.group_tables))
        ]
        if len(metas) > 1:
            metas[0].groups = metas
        return metas[0]

    def _group_metadata(
        self, group: int, size: int, cols: int, max_seq_len: int, width: int
    ) -> AttentionMetadata:
        """Decode rows (width 1), or verify rows as `size` prefill chunks of `width` tokens
        (static shapes: no host-side `seqs`)."""
        verify = width > 1
        return AttentionMetadata(
            slot_mapping=self.slot_mappings[group][: size * width],
            query_start_loc=self.starts[width][: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables[group][:size, :cols],
            num_prefills=size if verify else 0,
            num_prefill_tokens=size * width if verify else 0,
            max_query_len=width,
            max_seq_len=max_seq_len,
            block_size=self.kv.block_size,
            linear=None if self.state is None or verify else self._state_metadata(size),
        )

    def _state_metadata(self, size: int) -> StateMetadata:
        """One token per row; no host lists (a decode batch plans nothing on the host)."""
        return StateMetadata(
            query_start_loc=self.starts[1][: size + 1],
            state_slots=self.state_slots[:size],
            num_prefills=0,
            num_prefill_tokens=0,
            max_query_len=1,
        )
