"""StepPlanner: turns the scheduler's decision into a `StepPlan` for the runners.

It remembers, per sequence, how many tokens and blocks the runners already hold, so a plan
carries a request's data once and deltas afterwards, and it collects the ids the runners must
forget (finished, aborted, preempted) until the next plan takes them along.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

from raylane.actors.engine.scheduler import SchedulerOutput
from raylane.actors.engine.sequence import Sequence
from raylane.actors.runner.plan import CachedRequest, NewRequest, StepPlan


@dataclass
class _Known:
    num_tokens: int  # token ids the runners hold for the sequence
    num_blocks: int  # block ids they hold (0 after a preemption)
    num_group_blocks: tuple[int, ...] = ()  # likewise, per KV cache group after the first
    resumed: bool = False  # preempted since the last plan that named it


def _new_request(seq: Sequence) -> NewRequest:
    # NOTE: a sequence is new to the runners only before its first step, so its tokens are
    # exactly the prompt (a preempted one comes back as a resumed delta)
    return NewRequest(
        seq.seq_id,
        seq.index,
        tuple(seq.token_ids),
        tuple(seq.block_table),
        seq.num_computed_tokens,
        seq.params,
        tuple(tuple(table) for table in seq.group_tables),
        seq.lora.slot if seq.lora is not None else 0,
    )


class StepPlanner:
    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}
        self._finished: list[int] = []
        self._preempted: list[int] = []  # preempted between steps (a retract)
        self._step_ids = itertools.count()

    def plan(
        self,
        batch: SchedulerOutput,
        token_masks: dict[int, object] | None = None,
    ) -> StepPlan:
        """The plan of one step; the planner's memory changes only once it is built (a plan
        that raises leaves nothing half-recorded)."""
        new, cached, known = [], [], {}
        for item in batch.scheduled:
            seq = item.seq
            if seq.seq_id in self._known:
                cached.append(self._delta(seq))
            else:
                new.append(_new_request(seq))
            group_blocks = tuple(len(table) for table in seq.group_tables)
            known[seq.seq_id] = _Known(len(seq), len(seq.block_table), group_blocks)
        self.preempted(batch.preempted)
        plan = StepPlan(
            step_id=next(self._step_ids),
            new_requests=tuple(new),
            cached_requests=tuple(cached),
            scheduled=tuple(
                (item.seq.seq_id, item.num_new + len(item.drafts)) for item in batch.scheduled
            ),
            num_prefills=len(batch.prefills),
            finished_seq_ids=tuple(self._finished),
            preempted_seq_ids=tuple(self._preempted),
            token_masks=tuple((token_masks or {}).items()),
            draft_token_ids=tuple((i.seq.seq_id, i.drafts) for i in batch.scheduled if i.drafts),
            state_slots=_state_slots(batch),
            snapshot_restores=_snapshot_ops(batch, "restore_snapshot"),
            snapshot_saves=_snapshot_ops(batch, "save_snapshot"),
            snapshot_copies=batch.snapshot_copies,
        )
        self._known.update(known)
        self._finished, self._preempted = [], []
        return plan

    def preempted(self, seqs: list[Sequence]) -> None:
        """These sequences lost their blocks (the scheduler preempted them, or a retract): the
        next plan tells the runners to forget their block tables."""
        for seq in seqs:
            if self._mark_preempted(seq):
                self._preempted.append(seq.seq_id)

    def forget(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: the next plan tells the runners to drop it."""
        if self._known.pop(seq.seq_id, None) is not None:
            self._finished.append(seq.seq_id)

    def rolled_back(self, seq: Sequence, num_tokens: int) -> None:
        """The runners hold only `num_tokens` of the sequence's tokens (a grammar skip dropped
        the placeholder of a token that was never sampled)."""
        known = self._known.get(seq.seq_id)
        if known is not None:
            known.num_tokens = min(known.num_tokens, num_tokens)

    @property
    def num_known(self) -> int:
        return len(self._known)

    def _delta(self, seq: Sequence) -> CachedRequest:
        known = self._known[seq.seq_id]
        return CachedRequest(
            seq.seq_id,
            tuple(seq.runner_token_ids(known.num_tokens)),
            tuple(seq.block_table[known.num_blocks :]),
            seq.num_computed_tokens,
            known.resumed,
            tuple(
                tuple(table[known_blocks:])
                for table, known_blocks in zip(
                    seq.group_tables, known.num_group_blocks or [0] * len(seq.group_tables)
                )
            ),
        )

    def _mark_preempted(self, seq: Sequence) -> bool:
        known = self._known.get(seq.seq_id)
        if known is None or seq.seq_id in self._preempted:
            return False
        known.num_blocks, known.num_group_blocks, known.resumed = 0, (), True
        return True


def _state_slots(batch: SchedulerOutput) -> tuple[int, ...]:
    """Each row's state slot; () for a model without linear-attention layers."""
    slots = tuple(item.seq.state_slot for item in batch.scheduled)
    if all(slot is None for slot in slots):
        return ()
    assert None not in slots, "a linear-attention model's sequence was scheduled without a slot"
    return cast(tuple[int, ...], slots)


def _snapshot_ops(batch: SchedulerOutput, name: str) -> tuple[tuple[int, int], ...]:
    """(state slot, snapshot slot) of every row with a snapshot to restore or save."""
    ops = []
    for item in batch.scheduled:
        snapshot = getattr(item, name)
        if snapshot is not None:
            assert item.seq.state_slot is not None
            ops.append((item.seq.state_slot, snapshot))
    return tuple(ops)
