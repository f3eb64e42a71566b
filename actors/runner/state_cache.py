"""Per-sequence recurrent state of linear-attention layers: fixed pools of slots, one row per
sequence in every layer's conv and recurrent state tensors.

A slot is taken when a sequence is first scheduled and zeroed whenever the sequence starts from
token 0 (new, or resumed after preemption, which recomputes); it returns to the pool when the
plan says the sequence finished or was preempted. The pool holds `max_num_seqs` slots, the most
sequences the scheduler runs at once, so a scheduled sequence always finds one.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.engine.state_slots import StateSlotPool
from raylane.actors.runner.requests import ScheduledRequest
from raylane.kernels.linear_attention import StateMetadata


class StateCache:
    def __init__(self, layers: list[Any], num_slots: int, dtype: torch.dtype, device) -> None:
        self.layers, self.device = layers, device
        self.pool = StateSlotPool(num_slots)
        self.bytes_per_seq = 0
        for layer in layers:
            tensors = [
                torch.zeros((num_slots, *shape), dtype=dt or dtype, device=device)
                for shape, dt in layer.state_shapes()
            ]
            layer.attach_state(tensors)
            self.bytes_per_seq += sum(t[0].numel() * t.element_size() for t in tensors)

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.pool.free_sequence(seq_id)

    def metadata(self, scheduled: list[ScheduledRequest], num_prefills: int) -> StateMetadata:
        """The step's slots, in the step's flat order; zeroes the slot of every sequence that
        starts from its first token."""
        slots, qsl = [], [0]
        for item in scheduled:
            state = item.state
            slot = self.pool.allocate(state.seq_id)
            if state.num_computed_tokens == 0:
                self._zero(slot)
            slots.append(slot)
            qsl.append(qsl[-1] + item.num_new)
        return StateMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            state_slots=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_prefills=num_prefills,
            num_prefill_tokens=qsl[num_prefills],
            max_query_len=max((item.num_new for item in scheduled), default=1),
            query_start_loc_host=qsl,
            state_slots_host=slots,
        )

    def _zero(self, slot: int) -> None:
        for layer in self.layers:
            layer.conv_state[slot].zero_()
            layer.recurrent_state[slot].zero_()
