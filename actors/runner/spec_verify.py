"""Verifying drafts on the runner: a row with k drafts samples k + 1 positions in one pass.

Row j of a verify row is the target's distribution at output position n + j (n: the tokens
the sequence had), given the drafts before it. Each position is sampled exactly as a decode
step at that position would be (`Sampler`, with the position's own counter-based random
words), and the drafts are accepted while they equal what was sampled; the first mismatch's
sample (or, all accepted, the last row's) is the token the target adds.

For drafts from a point mass q (n-gram and suffix drafts, a drafter's argmax for greedy
requests, a seeded request's draft drawn with the position's own words: draft_sampling.py)
this is rejection sampling: the draft d is accepted with probability p(d) = min(1, p(d) /
q(d)), and on rejection the token is distributed as p without d, renormalised, which is the
residual max(0, p - q). Because every position uses the words a non-speculative step would
use, the tokens are those of decoding without drafts, seeded or not, greedy or sampled, at
any batch composition; and every logprob, top logprob and kept mass is the target's at that
position.

Drafts drawn from a distribution q (a draft model or MTP layers, for unseeded sampled
requests) carry q ([k, V]) and are verified by speculative sampling proper: kept with
probability min(1, p/q), else the token is the residual max(0, p - q)'s draw
(`kernels.sampling.speculative_accept`); the output is distributed as p, and logprobs are
still the target's at each position.
"""

from __future__ import annotations

from raylane.actors.runner.requests import RequestState, ScheduledRequest
from raylane.actors.runner.sampler import Proposal


class DraftPosition:
    """The sampler's view of a sequence `offset` drafts ahead: the drafts before the row count
    as its output (for penalties, min_tokens and the random words' position)."""

    __slots__ = ("_state", "_extra")

    def __init__(self, state: RequestState, drafts: tuple[int, ...]):
        self._state, self._extra = state, list(drafts)

    def __getattr__(self, name: str):
        return getattr(self._state, name)

    @property
    def token_ids(self) -> list[int]:
        return self._state.token_ids + self._extra

    @property
    def output_token_ids(self) -> list[int]:
        return self._state.output_token_ids + self._extra

    @property
    def num_output_tokens(self) -> int:
        return self._state.num_output_tokens + len(self._extra)


def sampling_rows(
    scheduled: list[ScheduledRequest], picks: list[int], logits_rows: list[tuple[int, int]]
) -> tuple[list[int], list, list[Proposal | None]]:
    """(logit row indices, sampler states, proposals) of every sampling position of the picked
    requests, in order: one per plain row, 1 + k per verify row. A proposal (the draft and
    its q) marks a position verified by min(1, p/q); None, one verified by equality."""
    rows: list[int] = []
    states: list = []
    proposals: list[Proposal | None] = []
    for i in picks:
        item = scheduled[i]
        first, count = logits_rows[i]
        for j in range(item.num_sample_rows):
            rows.append(first + count - item.num_sample_rows + j)
            states.append(DraftPosition(item.state, item.drafts[:j]) if j else item.state)
            q = item.draft_probs
            proposals.append(
                Proposal(item.drafts[j], q[j]) if q is not None and j < len(item.drafts) else None
            )
    return rows, states, proposals


def accept(scheduled: list[ScheduledRequest], picks: list[int], tokens: list[int]) -> list[int]:
    """For each pick, the index in `tokens` of its first sampled position; sets each verify
    row's `num_accepted` (leading drafts equal to the tokens sampled before them)."""
    firsts, at = [], 0
    for i in picks:
        item = scheduled[i]
        firsts.append(at)
        accepted = 0
        for draft, sampled in zip(item.drafts, tokens[at : at + len(item.drafts)]):
            if draft != sampled:
                break
            accepted += 1
        item.num_accepted = accepted
        at += item.num_sample_rows
    return firsts
