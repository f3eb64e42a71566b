"""The runner's own per-request state, keyed by seq_id, created and dropped by step plans.

Every rank applies the same plans, so every rank holds the same token histories, block tables
and counters (the logit rows a step computes depend on them, and collectives need equal shapes
on all ranks). Only the rank that samples fills in `last_sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.plan import (
    PLACEHOLDER,
    CachedRequest,
    NewRequest,
    StepPlan,
)


class RequestState:
    """One sequence as the runner sees it."""

    __slots__ = (
        "seq_id",
        "sample_index",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "block_ids",
        "group_block_ids",
        "num_computed_tokens",
        "last_sampled",
        "num_prompt_logprobs_done",
        "num_routed_reported",
        "num_indexer_reported",
        "skipped",
        "draft_proposal",
        "num_draft_computed",
    )

    def __init__(
        self,
        seq_id: int,
        sample_index: int,
        token_ids: list[int],
        block_ids: list[int],
        num_computed_tokens: int,
        params: SamplingParams,
        group_block_ids: list[list[int]] | None = None,
    ):
        self.seq_id = seq_id
        self.sample_index = sample_index
        self.params = params
        self.token_ids = list(token_ids)  # prompt, then every token fed or to be fed
        self.num_prompt_tokens = len(token_ids)
        self.block_ids = list(block_ids)
        # KV cache groups after the first (a model mixing sliding and full layers)
        self.group_block_ids = [list(ids) for ids in group_block_ids or []]
        self.num_computed_tokens = num_computed_tokens
        self.last_sampled: int | None = None  # on the sampling rank
        # prompt positions whose logprobs were reported; position 0 has none to report
        self.num_prompt_logprobs_done = 1 if params.prompt_logprobs is not None else 0
        self.num_routed_reported = 0  # positions whose routed experts were reported
        self.num_indexer_reported = 0  # likewise, indexer top-k (DSA)
        # its grammar mask was late (mask_board.py): it sampled nothing at its last step
        self.skipped = False
        # MTP (mtp_drafts.py): (output position of the first, drafts, q [drafts, V]) of the
        # drafts drawn for the next step, where min(1, p/q) verifies them
        self.draft_proposal: tuple[int, tuple[int, ...], Any] | None = None
        # a draft model (draft_runner.py): the positions whose KV this sequence itself wrote
        # into the draft's pool (a prefix-cache hit's blocks hold someone else's, or none)
        self.num_draft_computed = 0

    @classmethod
    def from_plan(cls, new: NewRequest) -> RequestState:
        return cls(
            new.seq_id,
            new.sample_index,
            list(new.token_ids),
            list(new.block_ids),
            new.num_computed_tokens,
            new.params,
            [list(ids) for ids in new.group_block_ids],
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    def table(self, group: int) -> list[int]:
        """KV cache group `group`'s block table (group 0's is `block_ids`)."""
        return self.block_ids if group == 0 else self.group_block_ids[group - 1]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def skip_last(self) -> None:
        """Its last step sampled nothing: compute its last position again."""
        self.num_computed_tokens -= 1
        self.last_sampled, self.skipped = None, True

    def update(self, delta: CachedRequest) -> None:
        new_tokens, num_computed = delta.new_token_ids, delta.num_computed_tokens
        if self.skipped and PLACEHOLDER in new_tokens:
            # planned before the engine saw the skip (async scheduling): it assumed a token
            # that was not sampled, one position further on; this step redoes the skipped one
            new_tokens, num_computed = new_tokens[:-1], num_computed - 1
        self.skipped = False
        for token in new_tokens:
            if token == PLACEHOLDER:
                if self.last_sampled is None:
                    raise RuntimeError(
                        f"seq {self.seq_id}: a placeholder token but this rank "
                        "sampled nothing for it"
                    )
                token = self.last_sampled
            self.token_ids.append(token)
        if delta.resumed:
            self.block_ids, self.group_block_ids = [], []
        self.block_ids.extend(delta.new_block_ids)
        if len(self.group_block_ids) < len(delta.new_group_block_ids):
            self.group_block_ids = [[] for _ in delta.new_group_block_ids]
        for table, new_ids in zip(self.group_block_ids, delta.new_group_block_ids):
            table.extend(new_ids)
        self.num_computed_tokens = num_computed
        # the draft's rows past the tokens computed now held rejected drafts
        self.num_draft_computed = min(self.num_draft_computed, num_computed)


@dataclass
class ScheduledRequest:
    """A request's part of one step."""

    state: RequestState
    num_new: int  # tokens computed for it this step (drafts included)
    drafts: tuple[int, ...] = ()  # speculative decoding: tokens fed after its last one
    num_accepted: int = 0  # of the drafts, how many the target agreed with (sampling rank)
    # the distributions q [k, V] the drafts were drawn from (verified by min(1, p/q)), or None
    draft_probs: Any = None
    # a draft model: the plan asked the runner for this many drafts here (draft_runner.py);
    # until they are drawn the row is its one fed token (`num_new` 1, no `drafts`)
    num_to_draft: int = 0

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its logits give a token."""
        return self.state.num_computed_tokens + self.num_new - len(self.drafts) == len(self.state)

    @property
    def num_sample_rows(self) -> int:
        """Logit rows that sample: the last token's, then one per draft."""
        return 1 + len(self.drafts) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        start = self.state.num_computed_tokens
        return self.state.token_ids[start : start + self.num_new - len(self.drafts)] + list(
            self.drafts
        )

    @property
    def context_len(self) -> int:
        return self.state.num_computed_tokens + self.num_new


def _scheduled(state: RequestState, n: int, drafts: tuple[int, ...] | None) -> ScheduledRequest:
    """A plan entry; placeholder drafts ask the runner's draft model to draw them."""
    if drafts and drafts[0] == PLACEHOLDER:
        return ScheduledRequest(state, n - len(drafts), num_to_draft=len(drafts))
    return ScheduledRequest(state, n, drafts or ())


class RequestTable:
    """All requests a runner knows; `apply(plan)` brings them up to the plan's step.

    When a step raises, `fail` drops the state of its requests: the engine ends them with an
    error, but a plan built before it knew (async scheduling) may still name them, so their
    entries in later plans are skipped until a plan says they finished.
    """

    def __init__(self) -> None:
        self.states: dict[int, RequestState] = {}
        self.failed: set[int] = set()

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, plan: StepPlan) -> list[ScheduledRequest | None]:
        """Forget, add and update as the plan says; returns the step's requests in flat order
        (None for a failed request's entry)."""
        for seq_id in plan.finished_seq_ids:
            self.states.pop(seq_id, None)
            self.failed.discard(seq_id)
        for seq_id in plan.preempted_seq_ids:
            if seq_id not in self.failed:
                state = self._get(seq_id)
                state.block_ids, state.num_computed_tokens = [], 0
                state.group_block_ids, state.num_draft_computed = [], 0
        for new in plan.new_requests:
            self.states[new.seq_id] = RequestState.from_plan(new)
        for delta in plan.cached_requests:
            if delta.seq_id not in self.failed:
                self._get(delta.seq_id).update(delta)
        drafts = dict(plan.draft_token_ids)
        return [
            None if seq_id in self.failed else _scheduled(self._get(seq_id), n, drafts.get(seq_id))
            for seq_id, n in plan.scheduled
        ]

    def fail(self, plan: StepPlan) -> None:
        """The plan's step raised: drop the state of every request it named."""
        for seq_id in [new.seq_id for new in plan.new_requests] + [s for s, _ in plan.scheduled]:
            self.states.pop(seq_id, None)
            self.failed.add(seq_id)

    def _get(self, seq_id: int) -> RequestState:
        state = self.states.get(seq_id)
        if state is None:
            raise RuntimeError(f"step plan names seq {seq_id}, which this runner does not know")
        return state

    @staticmethod
    def advance(scheduled: list[ScheduledRequest]) -> None:
        """After the forward pass: the step's tokens are in the KV cache (a verify row's
        accepted drafts count once the engine's next plan says so)."""
        for item in scheduled:
            item.state.num_computed_tokens += item.num_new - len(item.drafts)
