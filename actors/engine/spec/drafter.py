"""Drafter, the engine's `Speculation` when it speculates (spec/speculation.py): give a
scheduled step's decoding sequences their drafts, and fold back what the target accepted.

Drafting happens after the scheduler chose the step and before it is planned: a decode row
with k drafts becomes a chunk of 1 + k query tokens (the last sampled token, then the drafts),
verified by the runner in the same forward as everything else. Its blocks are allocated here
for all 1 + k positions; the scheduler still counts one new token, so after the result only
the accepted positions count as computed (`accepted`), the rejected slots are simply written
over by later steps, and the prefix cache registers only blocks full of accepted tokens.

A sequence with a token in flight (async scheduling planned this step ahead) drafts past a
guess of that token (`_past_pending`); the step after a verify step is planned once the verify
step returned (`plans_serially`), as its accepted count decides the positions.
"""

from __future__ import annotations

import time

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.scheduler import ScheduledSeq, SchedulerOutput
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.spec.acceptance import NUM_CLASSES, AcceptanceTable, match_class
from raylane.actors.engine.spec.backoff import Backoff, LookupBackoff
from raylane.actors.engine.spec.config import SpeculativeConfig
from raylane.actors.engine.spec.cost_model import CostModel
from raylane.actors.engine.spec.metrics import SpecStats
from raylane.actors.engine.spec.proposer import Proposer
from raylane.actors.runner.plan import PLACEHOLDER, StepResult


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        blocks: BlockManager,
        max_num_batched_tokens: int,
        max_model_len: int | None,
        stats: SpecStats,
    ):
        self.config = config
        self.k = config.num_speculative_tokens
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stats = stats
        self.backoff = Backoff()
        # the batch's lookups; with `adaptive` off every proposal is sent, nothing backs off
        self.lookups = LookupBackoff()
        self.cost = CostModel()
        self.acceptance = AcceptanceTable(self.k)  # per match class and draft position
        self._finished_at: float | None = None  # when the runner finished the last step
        # seq_id -> the match class of its last proposal (None: it had none; unknown: the best)
        self._last_class: dict[int, int | None] = {}
        self._drafted_class: dict[int, int] = {}  # seq_id -> the class of its drafts in flight
        self.proposer = Proposer(config)

    def active(self, num_decoding: int) -> bool:
        """Speculate for a batch of this many running sequences (the adaptive switch)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_decoding <= limit

    def wants_serial(self, running: list[Sequence]) -> bool:
        """The next step should draft with the tokens in flight known, so it should be planned
        after the step in flight returns: some running sequence had a match last time, and
        the drafts expected of such rows pay for the verify step and for the two steps
        planned without the async overlap (it and the step after it). Else async planning
        goes on (and rows draft past a guess of their token in flight)."""
        num = len(running)
        if not self.active(num):
            return False
        depths = self._depths(num, num)
        if not any(depths):
            return False
        drafts = []
        for seq in running:
            cls = self._last_class.get(seq.seq_id, NUM_CLASSES - 1)
            if cls is not None and depths[cls] and self._may_draft(seq):
                drafts.append((cls, depths[cls]))
        return bool(drafts) and self._pays(num, num, drafts, serial=2)

    def plans_serially(self, due: list[ScheduledSeq], running: list[Sequence]) -> bool:
        """The due step verifies drafts (how many tokens it adds is unknown until it returns),
        or the next step would draft (`wants_serial`)."""
        return any(item.drafts for item in due) or self.wants_serial(running)

    def _worth(self, num_rows: int, num_tokens: int) -> int:
        """How many leading draft positions pay for their own tokens' compute, for the best
        match class (see `_depths`)."""
        return max(self._depths(num_rows, num_tokens))

    def _depths(self, num_rows: int, num_tokens: int) -> list[int]:
        """Per match class: how many leading draft positions pay for their own tokens'
        compute (CostModel), by the acceptance measured at each position (optimistic until
        measured)."""
        if not self.config.adaptive:
            return [self.k] * NUM_CLASSES
        return self.acceptance.depths(self.cost.threshold(num_rows, num_tokens))

    def _step_s(self, num_tokens: int) -> float | None:
        """A plain step of `num_tokens` tokens as CostModel's fit predicts it (None: unfitted)."""
        fit = self.cost.fit()
        return None if fit is None else fit[0] + fit[1] * num_tokens

    def _pays(
        self, num_rows: int, num_tokens: int, drafts: list[tuple[int, int]], serial: int
    ) -> bool:
        """Do drafts of these (match class, length)s, in a step of `num_rows` sampling rows
        and `num_tokens` tokens, pay for the verify step and `serial` steps planned serially
        (CostModel)?"""
        if not self.config.adaptive:
            return True
        expected = self.acceptance.expected(drafts)
        return self.cost.pays(num_rows, num_tokens, expected, sum(n for _, n in drafts), serial)

    def observe(
        self, scheduled: list[ScheduledSeq], timings: dict[str, float], ahead: bool
    ) -> None:
        """A step's runner time and the runner's idle time before it (`ahead`: it was planned
        while the step before ran), for the cost model. Only decode and verify steps' times
        are fitted (prefill chunks add attention costs the linear fit does not describe)."""
        seconds = sum(timings.get(k, 0.0) for k in ("prepare", "forward", "sample"))
        if self._finished_at is not None and "started_at" in timings:
            gap = timings["started_at"] - self._finished_at
            if 0.0 <= gap < 2 * seconds:  # longer: the engine had no work, not host work
                self.cost.observe_gap(ahead, gap)
        self._finished_at = timings.get("finished_at")
        if scheduled and all(item.is_decode for item in scheduled) and "forward" in timings:
            verifies = any(item.drafts for item in scheduled)
            self.stats.num_verify_steps += verifies
            self.cost.observe(sum(1 + len(item.drafts) for item in scheduled), seconds, verifies)

    def _may_draft(self, seq: Sequence) -> bool:
        return seq.matcher is None and self.backoff.ready(seq.seq_id) and self._room(seq) > 0

    def draft(self, batch: SchedulerOutput) -> None:
        """Propose drafts for the batch's decode rows and allocate their slots; rows with
        drafts move to the front part of the step (they are short prefill-like chunks)."""
        self.backoff.tick()
        self.lookups.tick()
        if batch.decodes and self.active(len(batch.decodes) + len(batch.prefills)):
            self._draft_decodes(batch)
            if not any(item.drafts for item in batch.prefills):
                self.acceptance.fade()
        if self.config.method == "mtp" and self.k > 1:
            self._reserve_chain(batch)

    def _draft_decodes(self, batch: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens - batch.num_tokens
        rows = len(batch.decodes) + sum(item.samples for item in batch.prefills)
        depths = self._depths(rows, batch.num_tokens)
        worth = max(depths)
        if worth == 0 or not self.lookups.ready(0):
            return
        proposed: list[tuple[ScheduledSeq, list[int], int]] = []
        start = time.perf_counter()
        for item in batch.decodes:
            drafts, cls = self._propose(item.seq, min(worth, budget))
            drafts = drafts[: depths[cls]]  # the positions that pay for this match class
            if drafts:
                proposed.append((item, drafts, cls))
                budget -= len(drafts)
        classed = [(cls, len(drafts)) for _, drafts, cls in proposed]
        paid = bool(proposed) and self._pays(rows, batch.num_tokens, classed, serial=1)
        if paid or self.config.adaptive:
            seconds = time.perf_counter() - start
            self.lookups.after_step(paid, seconds, self._step_s(batch.num_tokens))
        if not paid:
            return  # the step after a verify step is planned serially: one lost overlap
        drafted: list[ScheduledSeq] = []
        for item, drafts, cls in proposed:
            if self._allocate(item.seq, len(drafts)):
                item.drafts = tuple(drafts)
                self._drafted_class[item.seq.seq_id] = cls
                drafted.append(item)
        if drafted:
            batch.prefills += drafted
            batch.decodes = [item for item in batch.decodes if not item.drafts]

    def _propose(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to k drafts and their match class; a draft model's are placeholders, drawn on
        the runner (runner/draft_runner.py), which keeps their q where min(1, p/q) verifies
        them."""
        if not self._may_draft(seq):
            return [], 0
        k = min(k, self._room(seq))
        if seq.num_pending:
            return self._past_pending(seq, k)
        drafts: list[int] = []
        match = 1
        if k > 0 and self.config.method == "draft_model":
            drafts = [PLACEHOLDER] * k
        elif k > 0:
            drafts, match = self._lookup(seq, k)
        self._last_class[seq.seq_id] = match_class(match) if drafts else None
        return drafts, match_class(match)

    def _past_pending(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Drafts for a sequence whose last token is in flight (this step is planned ahead,
        async): a lookup one token behind gives the continuation c; c[0] is a guess of the
        token in flight and c[1:] the drafts after it. A wrong guess only costs a rejected
        draft: the runner verifies the drafts after the token it really sampled, so outputs
        stay exact. A draft model or MTP layer would need that token: no drafts, but they
        always have a proposal for the step after (so that one is planned serially)."""
        if self.config.method in ("draft_model", "mtp"):
            self._last_class[seq.seq_id] = 0
            return [], 0
        found, match = self._lookup(seq, k + 1)
        cls = match_class(match)
        self._last_class[seq.seq_id] = cls if found else None
        return (found[1:] if seq.num_pending == 1 else []), cls

    def _lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Drafts that need no distribution (n-gram, suffix, the runner's MTP draft) and the
        length of the match they follow (spec/proposer.py)."""
        return self.proposer.lookup(seq, k)

    def _room(self, seq: Sequence) -> int:
        """Drafts worth verifying: the step yields at most drafts + 1 tokens, and none past
        max_tokens or the context length."""
        room = self.k
        if seq.params.max_tokens is not None:
            done = seq.num_output_tokens + seq.num_pending
            room = min(room, seq.params.max_tokens - done - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(seq))
        return room

    def _reserve_chain(self, batch: SchedulerOutput) -> None:
        """Chained MTP steps (runner/mtp_drafts.py) write their cache rows at the k - 1
        positions after a sampling row's newest token: allocate their slots now where blocks
        are free (the next step needs them anyway); a row without them drafts fewer."""
        for item in batch.scheduled:
            if not item.samples:
                continue
            end = item.start + item.num_new + len(item.drafts) + self.k - 1
            if self.max_model_len is not None:
                end = min(end, self.max_model_len)
            need = self.blocks.blocks_needed(item.seq, end - item.start)
            if need and self.blocks.can_allocate(need):
                self.blocks.allocate(item.seq, end - item.start)

    def _allocate(self, seq: Sequence, num_drafts: int) -> bool:
        need = self.blocks.blocks_needed(seq, 1 + num_drafts)
        if not self.blocks.can_allocate(need):
            return False
        self.blocks.allocate(seq, 1 + num_drafts)
        return True

    def verified(self, item: ScheduledSeq, result: StepResult, row: int) -> None:
        """Row `row` of the step came back: a draft model's drafts (drawn on the runner) become
        the row's, its drafts' accepted count is folded in, and the MTP layers' drafts for the
        tokens after its newest one are kept."""
        drawn = result.drafts[row] if result.drafts else None
        if drawn is not None:
            item.drafts = tuple(drawn)
        if item.drafts:
            extra = result.extra[row]
            self.accepted(item, len(extra.token_ids) if extra else 0)
        tokens = result.mtp_drafts[row] if result.mtp_drafts else None
        if tokens:
            self.proposer.keep_mtp(item.seq, tokens)

    def accepted(self, item: ScheduledSeq, num_accepted: int) -> None:
        """The step's result: `num_accepted` leading drafts were right. Their positions are
        computed KV now (the rejected ones are not); full blocks of them join the prefix cache."""
        self.stats.record(len(item.drafts), num_accepted)
        self.backoff.record(item.seq.seq_id, len(item.drafts), num_accepted)
        if item.drafts:
            cls = self._drafted_class.pop(item.seq.seq_id, 0)
            self.acceptance.record(cls, len(item.drafts), num_accepted)
        seq = item.seq
        if seq.num_preemptions != item.preemptions or seq.is_finished:
            return
        seq.num_computed_tokens += num_accepted
        self.blocks.commit_full_blocks(seq, item.start + 1 + num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq.seq_id)
        self.backoff.forget(seq.seq_id)
        self._last_class.pop(seq.seq_id, None)
        self._drafted_class.pop(seq.seq_id, None)
