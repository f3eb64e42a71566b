"""Continuous batching: one token budget per step shared by decodes and (chunked) prefills."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.sequence import Sequence, SequenceStatus
from raylane.actors.engine.state_slots import StateSlotPool


@dataclass
class ScheduledSeq:
    """A sequence's part of one step, as it was when the step was scheduled."""

    seq: Sequence
    num_new: int  # tokens computed for it this step
    start: int = field(init=False)  # tokens in its KV cache before the step
    samples: bool = field(init=False)  # the chunk reaches the end: its logits give a token
    preemptions: int = field(init=False)  # its preemption count then (a later one voids it)
    # speculative decoding: tokens to verify after its one new token (see engine/spec)
    drafts: tuple[int, ...] = field(default=(), init=False)
    # linear-attention models: the snapshot its state starts from (a prefix-cache hit), and
    # the snapshot slot its state is copied to once the step ends (the chunk ends on a block)
    restore_snapshot: int | None = field(default=None, init=False)
    save_snapshot: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new == len(self.seq)
        self.preemptions = self.seq.num_preemptions

    @property
    def is_decode(self) -> bool:
        return self.num_new == 1 and self.seq.prompt_done


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (decode row, snapshot slot) copies to run before the step (see state_slots.py)
    snapshot_copies: tuple[tuple[int, int], ...] = ()

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes  # the flat token order of the step

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    """Moves sequences between the waiting queue and the running list, first come first served.

    Running sequences are served first (oldest first); when blocks run out the newest running
    sequence is preempted by recompute and goes back to the head of the queue. A model with
    linear-attention layers also needs a state slot per running sequence (`states`): one is
    taken on admission (the head of the queue waits while none is free) and given back with
    the blocks.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        states: StateSlotPool | None = None,
    ):
        self.blocks = block_manager
        self.states = states
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if self.blocks.snapshots is not None and not out.is_empty:
            # decode rows published since the last plan; an empty step sends no plan
            out.snapshot_copies = self.blocks.snapshots.take_copies()
        # decodes by context length: attention can then pad short and long contexts apart
        out.decodes.sort(key=lambda item: len(item.seq))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        queue = list(self.running)
        waiting_on_last: list[Sequence] = []
        while queue and budget > 0:
            seq = queue.pop(0)
            if seq.will_finish(self.max_model_len):  # its last token is in flight
                waiting_on_last.append(seq)
                continue
            # sliding layers: blocks wholly before their window go back
            # NOTE: before this step's allocation, from the count before its tokens: what its
            # queries can still see stays, so a freed block is never reused under them
            self.blocks.free_outside_windows(seq)
            num_new = self._chunk(seq, budget)
            while not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_new)):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, num_new)
                self._emit(out, self._item(seq, num_new))
                scheduled.append(seq)
                budget -= num_new
        # sequences left in `queue` got no budget this step and keep their place
        self.running = scheduled + waiting_on_last + queue
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self._has_room():
            seq = self.waiting[0]
            if not seq.prefix_looked_up:
                self._admit_cached_prefix(seq)
            num_new = self._chunk(seq, budget)
            if not self.blocks.can_allocate(self.blocks.blocks_needed(seq, num_new)):
                if not self.running:
                    self._check_fits(seq)
                # give the cached prefix back: holding it while waiting could starve the
                # sequences ahead of it (a preempted one) and deadlock the engine
                self.blocks.free_sequence(seq)
                seq.num_computed_tokens = 0
                seq.prefix_looked_up = False
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.allocate(seq, num_new)
            if self.states is not None:
                seq.state_slot = self.states.allocate(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            item = self._item(seq, num_new)
            item.restore_snapshot, seq.restore_snapshot = seq.restore_snapshot, None
            self._emit(out, item)
            budget -= num_new

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute for it this step. A model with state snapshots ends a prompt's
        chunk on its last block boundary, so the state there can be snapshotted."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        boundary = self._snapshot_boundary(seq)
        if seq.num_computed_tokens < boundary:
            num_new = min(num_new, boundary - seq.num_computed_tokens)
        return num_new

    def _snapshot_boundary(self, seq: Sequence) -> int:
        """The last block boundary a prefix-cache hit on this prompt can reach (0: none)."""
        if self.blocks.snapshots is None:
            return 0
        size = self.blocks.block_size
        return (seq.num_prompt_tokens - 1) // size * size

    def _item(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        item = ScheduledSeq(seq, num_new)
        boundary, end = self._snapshot_boundary(seq), item.start + num_new
        size, snapshots = self.blocks.block_size, self.blocks.snapshots
        if boundary and end == boundary:
            item.save_snapshot = self.blocks.reserve_snapshot(seq, boundary // size)
        elif snapshots is not None and item.is_decode and end % size == 0:
            # a decode step ending on a block: its state goes to the slot's decode row
            assert seq.state_slot is not None
            item.save_snapshot = snapshots.decode_row(seq.state_slot)
            seq.decode_snapshot_at = end
        return item

    def _has_room(self) -> bool:
        """Another sequence may start: under max_num_seqs, and a state slot free if needed."""
        slots = self.states is None or self.states.can_allocate()
        return slots and len(self.running) < self.max_num_seqs

    def _release(self, seq: Sequence) -> None:
        """Its blocks and state slot go back (finished, or preempted to recompute); its last
        decode boundary's state is published for prefix caching first."""
        self._publish_decode_snapshot(seq)
        self.blocks.free_sequence(seq)
        if self.states is not None:
            self.states.free_sequence(seq.seq_id)
        seq.state_slot = None

    def _publish_decode_snapshot(self, seq: Sequence) -> None:
        """Publish the state in the slot's decode row under its block's chain hash, if that
        block is committed to the prefix cache (a boundary a step still in flight planned is
        not: the row may hold it, or not yet)."""
        snapshots, at, seq.decode_snapshot_at = self.blocks.snapshots, seq.decode_snapshot_at, 0
        if snapshots is None or not at or seq.state_slot is None:
            return
        blocks = at // self.blocks.block_size
        if blocks > seq.num_hashed_blocks:
            return
        chain_hash = self.blocks.blocks[seq.block_table[blocks - 1]].hash
        if chain_hash is not None:
            snapshots.publish(seq.state_slot, chain_hash)

    def _admit_cached_prefix(self, seq: Sequence) -> None:
        seq.prefix_looked_up = True
        seq.cache_version = self.blocks.version  # its KV is computed under today's weights
        if seq.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt row computed
        cached = self.blocks.allocate_cached_prefix(seq)
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached

    def _check_fits(self, seq: Sequence) -> None:
        need = self.blocks.groups.blocks_to_hold(len(seq), self.max_num_batched_tokens)
        if need > self.blocks.num_blocks:
            raise RuntimeError(
                f"request {seq.request_id} needs {need} KV blocks but the cache "
                f"has {self.blocks.num_blocks}; raise num_kv_blocks"
            )

    @staticmethod
    def _emit(out: SchedulerOutput, item: ScheduledSeq) -> None:
        (out.decodes if item.is_decode else out.prefills).append(item)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def retract_all(self) -> list[Sequence]:
        """Preempt every running sequence (its KV freed, recomputed when scheduled again),
        keeping their order at the head of the queue."""
        retracted = list(self.running)
        for seq in reversed(retracted):
            self._release(seq)
            seq.reset_for_recompute()
            self.waiting.appendleft(seq)
        self.running = []
        return retracted

    # --- after the step -----------------------------------------------------------------------

    def launched(self, item: ScheduledSeq) -> None:
        """The step is on its way: schedule on as if it had computed its tokens, and count the
        token it will sample as pending (the next step can then be planned before it ends)."""
        item.seq.num_computed_tokens += item.num_new
        if item.samples:
            item.seq.num_pending += 1

    def confirm(self, item: ScheduledSeq) -> None:
        """The step's result arrived: its full blocks join the prefix cache (unless the
        sequence was preempted since), and a finished prompt releases the n > 1 siblings."""
        seq = item.seq
        if seq.num_preemptions == item.preemptions:
            self.blocks.commit_full_blocks(seq, item.start + item.num_new)
        if item.start + item.num_new >= seq.num_prompt_tokens and seq.siblings:
            for sibling in reversed(seq.siblings):  # n > 1: they now hit the prompt's blocks
                self.waiting.appendleft(sibling)
            seq.siblings = []

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.num_pending = 0  # what steps in flight sample for it is dropped
        for sibling in seq.siblings:  # aborted before its prompt finished
            sibling.status = SequenceStatus.FINISHED
        seq.siblings = []
