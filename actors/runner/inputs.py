"""Input preparation: turn the scheduler's decision into the step's tensors.

Kept apart from the forward pass so it can run ahead of it (async prepare) and so decode can be
replayed from captured graphs with the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.scheduler import ScheduledSeq, SchedulerOutput
from kernels.attention import AttentionMetadata
from kernels.attention.builder import SeqSlice, build_metadata


@dataclass
class StepInputs:
    """Every tensor one forward pass needs, built once per step."""

    input_ids: torch.Tensor  # [T] int64, prefill chunks first, then decodes
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64 rows of the hidden states that need logits
    # per scheduled item, in order: (first row in logits_indices, number of rows)
    logits_rows: list[tuple[int, int]]


class InputPreparer:
    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype):
        self.block_size = block_size
        self.device = device
        self.dtype = dtype

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        logits_rows: list[tuple[int, int]] = []
        for item in batch.scheduled:
            start = item.seq.num_computed_tokens
            first_row = len(ids)
            ids.extend(item.seq.token_ids[start:start + item.num_new])
            positions.extend(range(start, start + item.num_new))
            rows = _logit_rows(item, first_row)
            logits_rows.append((len(logits_idx), len(rows)))
            logits_idx.extend(rows)
        attn = build_metadata([_slice(i) for i in batch.prefills],
                              [_slice(i) for i in batch.decodes], self.block_size, self.device,
                              self.dtype)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return StepInputs(as_tensor(ids), as_tensor(positions), attn, as_tensor(logits_idx),
                          logits_rows)


def _slice(item: ScheduledSeq) -> SeqSlice:
    seq = item.seq
    return SeqSlice(item.num_new, seq.num_computed_tokens + item.num_new, seq.block_table)


def _logit_rows(item: ScheduledSeq, first_row: int) -> list[int]:
    """Rows that need logits: the last one when it samples, every prompt row for prompt_logprobs."""
    seq = item.seq
    rows = []
    if seq.params.prompt_logprobs is not None:
        # row j predicts token start + j + 1: keep rows whose target is a prompt token not yet
        # recorded (a recompute after preemption does not record twice)
        start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
        rows = [first_row + j for j in range(item.num_new)
                if done <= start + j + 1 < seq.num_prompt_tokens]
    if item.samples:
        rows.append(first_row + item.num_new - 1)
    return rows
