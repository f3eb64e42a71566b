"""Per-sequence recurrent state of linear-attention layers: fixed pools of slots, one row per
sequence in every layer's conv and recurrent state tensors.

The engine's scheduler hands the slots out (`StateSlotPool`, with the KV blocks) and the plan
names each scheduled row's slot; this cache only holds the tensors. A slot is zeroed whenever
its sequence starts from token 0 (new, or resumed after preemption, which recomputes), so a slot
a finished sequence left behind never leaks into the next one. One row more than `num_slots`
is allocated: the scratch slot, never handed out, whose state the padding rows of a
graph-replayed decode batch read and write.

Prefix caching keeps `num_snapshots` more rows per layer: copies of a slot taken when a prompt's
chunk ends on its last block boundary (`save`), copied back into the slot of a request whose
prefix-cache hit ends there (`restore`); then one decode row per slot (a decoding sequence's
latest block boundary, `copy`-ed into the pool when it ends); the block manager's
`SnapshotCache` says which row is which.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.runner.requests import ScheduledRequest
from raylane.kernels.linear_attention import StateMetadata
from raylane.kernels.linear_attention.metadata import VerifyRows
from raylane.kernels.linear_attention.verify import advance


class StateCache:
    def __init__(
        self, layers: list[Any], num_slots: int, dtype: torch.dtype, device, num_snapshots: int = 0
    ) -> None:
        self.device = device
        self.layers = layers
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.bytes_per_seq = 0
        # per layer: its state tensors [num_slots, ...] and their snapshot rows [num_snapshots, ...]
        self.states: list[list[torch.Tensor]] = []
        self.snapshots: list[list[torch.Tensor]] = []
        for layer in layers:
            shapes = [(shape, dt or dtype) for shape, dt in layer.state_shapes()]
            rows = num_slots + 1  # + the scratch slot
            tensors = [torch.zeros((rows, *s), dtype=dt, device=device) for s, dt in shapes]
            layer.attach_state(tensors)
            self.states.append(tensors)
            rows = num_snapshots + num_slots if num_snapshots else 0  # + the decode rows
            self.snapshots.append(
                [torch.zeros((rows, *s), dtype=dt, device=device) for s, dt in shapes]
            )
            self.bytes_per_seq += sum(t[0].numel() * t.element_size() for t in tensors)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_bytes(self) -> int:
        """Slots, snapshots and decode rows together."""
        decode_rows = self.num_slots if self.num_snapshots else 0
        return self.bytes_per_seq * (self.num_slots + self.num_snapshots + decode_rows)

    def copy(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(source row, destination row) between snapshot rows, in order."""
        for snaps in self.snapshots:
            for src, dst in pairs:
                for saved in snaps:
                    saved[dst].copy_(saved[src])

    def restore(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(slot, snapshot): the slot starts from the snapshot (before the step)."""
        for states, snaps in zip(self.states, self.snapshots):
            for slot, snap in pairs:
                for state, saved in zip(states, snaps):
                    state[slot].copy_(saved[snap])

    def save(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(slot, snapshot): the snapshot takes the slot's state (after the step)."""
        for states, snaps in zip(self.states, self.snapshots):
            for slot, snap in pairs:
                for state, saved in zip(states, snaps):
                    saved[snap].copy_(state[slot])

    def metadata(
        self, scheduled: list[ScheduledRequest], num_prefills: int, slots: list[int]
    ) -> StateMetadata:
        """The step's slots (`slots`, one per scheduled row, from the plan) in the step's flat
        order; zeroes the slot of every sequence that starts from its first token."""
        qsl = [0]
        for item, slot in zip(scheduled, slots, strict=True):
            if item.state.num_computed_tokens == 0:
                self._zero(slot)
            qsl.append(qsl[-1] + item.num_new)
        rows = [i for i, item in enumerate(scheduled) if item.drafts]
        verify = VerifyRows(rows, [scheduled[i].num_new for i in rows]) if rows else None
        return StateMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            state_slots=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_prefills=num_prefills,
            num_prefill_tokens=qsl[num_prefills],
            max_query_len=max((item.num_new for item in scheduled), default=1),
            query_start_loc_host=qsl,
            state_slots_host=list(slots),
            verify=verify,
        )

    def save_after(self, meta: StateMetadata, pairs: tuple[tuple[int, int], ...]) -> None:
        """`save` after the forward; a verify row's save (a decode row: the step's first token
        ends on a block) waits for `accept`, which replays that token first."""
        verify = set(meta.verify.slots(meta)) if meta.verify is not None else set()
        self.save(tuple(p for p in pairs if p[0] not in verify))

    def accept(self, meta: StateMetadata, scheduled: list[ScheduledRequest], saves: tuple) -> None:
        """Verify rows (after sampling, on every rank): each slot takes its row's first token
        and accepted drafts (`num_accepted`), nothing of the rejected ones (verify.py)."""
        verify = meta.verify
        if verify is None:
            return
        slots = verify.slots(meta)
        counts = [1 + scheduled[i].num_accepted for i in verify.seqs]
        deferred = tuple(p for p in saves if p[0] in set(slots))
        advance(
            self.layers, verify.records, slots, counts, verify.offsets(),
            lambda: self.save(deferred),
        )  # fmt: skip

    def _zero(self, slot: int) -> None:
        for states in self.states:
            for state in states:
                state[slot].zero_()
