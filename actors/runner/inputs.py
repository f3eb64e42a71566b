"""Input preparation: turn a step's scheduled requests into the step's tensors.

Kept apart from the forward pass so it can run ahead of it (async prepare) and so decode can be
replayed from captured graphs with the same tensors. It reads only the runner's own request
state (never the engine's sequences), so every rank builds the same tensors from the same plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from raylane.actors.runner.requests import ScheduledRequest
from raylane.kernels.attention import AttentionMetadata
from raylane.kernels.attention.builder import (
    SeqSlice,
    block_tables,
    build_metadata,
    slot_mapping,
)


@dataclass
class StepInputs:
    """Every tensor one forward pass needs, built once per step."""

    input_ids: torch.Tensor  # [T] int64, prefill chunks first, then decodes
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64 rows of the hidden states that need logits
    # per scheduled request, in order: (first row in logits_indices, number of rows)
    logits_rows: list[tuple[int, int]]
    # grammar masks by seq_id, set after the forward (features/grammar_masks.py): an int32 bit
    # set [ceil(vocab / 32)], None, or mask_board.SKIP (a late row that samples nothing)
    masks: dict[int, object] = field(default_factory=dict)


class InputPreparer:
    def __init__(self, block_size: int, device: torch.device, num_groups: int = 1):
        self.block_size = block_size
        self.device = device
        self.num_groups = num_groups  # KV cache groups: block tables per sequence

    def prepare(
        self,
        scheduled: list[ScheduledRequest],
        num_prefills: int,
        behind: list[int] | None = None,
    ) -> StepInputs:
        """`behind[i]`: entry i's chunk starts that many of its known tokens earlier (the
        positions a draft model's pool lacks, draft_runner.py)."""
        behind = behind or [0] * len(scheduled)
        ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        logits_rows: list[tuple[int, int]] = []
        for item, back in zip(scheduled, behind):
            start = item.state.num_computed_tokens
            first_row = len(ids) + back
            ids.extend(item.state.token_ids[start - back : start] + item.input_token_ids())
            positions.extend(range(start - back, start + item.num_new))
            rows = logit_rows(item, first_row)
            logits_rows.append((len(logits_idx), len(rows)))
            logits_idx.extend(rows)
        slices = _slices(scheduled, behind, 0)
        attn = build_metadata(
            slices[:num_prefills], slices[num_prefills:], self.block_size, self.device
        )
        if self.num_groups > 1:
            attn.groups = [attn] + [
                self._group(attn, _slices(scheduled, behind, g)) for g in range(1, self.num_groups)
            ]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return StepInputs(
            as_tensor(ids), as_tensor(positions), attn, as_tensor(logits_idx), logits_rows
        )

    def _group(self, attn: AttentionMetadata, slices: list[SeqSlice]) -> AttentionMetadata:
        """A KV cache group's metadata: `attn`'s rows and lengths (shared) over that group's
        block tables and slot mapping."""
        slots = torch.tensor(slot_mapping(slices, self.block_size), dtype=torch.long)
        return dataclasses.replace(
            attn,
            slot_mapping=slots.to(self.device),
            block_tables=block_tables(slices, self.block_size).to(self.device),
            seqs=slices,
            plan=None,
            groups=None,
        )


def _slices(scheduled: list[ScheduledRequest], behind: list[int], group: int) -> list[SeqSlice]:
    """Each row's part of the step over KV cache group `group`'s block table, in flat order."""
    return [
        SeqSlice(item.num_new + back, item.context_len, item.state.table(group))
        for item, back in zip(scheduled, behind)
    ]


def logit_rows(item: ScheduledRequest, first_row: int) -> list[int]:
    """Rows that need logits: the prompt rows for prompt_logprobs, then the last one when it
    samples.

    Prompt row j predicts token start + j + 1: keep rows whose target is a prompt token not yet
    reported (a recompute after preemption does not report twice).
    """
    state = item.state
    rows = []
    if state.params.prompt_logprobs is not None:
        start, done = state.num_computed_tokens, state.num_prompt_logprobs_done
        rows = [
            first_row + j
            for j in range(item.num_new)
            if done <= start + j + 1 < state.num_prompt_tokens
        ]
    # the sampling rows: the last one, or a verify row's last 1 + drafts
    rows.extend(range(first_row + item.num_new - item.num_sample_rows, first_row + item.num_new))
    return rows
