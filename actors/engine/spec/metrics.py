"""Speculative decoding counters (vLLM's names): what was drafted and what the target kept.

Counted from the verify results themselves, so a path that drafts but never reports (the
silent zero) shows as drafts without acceptances, and tests compare them with an independent
count of the tokens each step produced.
"""

from __future__ import annotations


class SpecStats:
    def __init__(self, num_speculative_tokens: int = 0):
        self.num_drafts = 0  # sequences that carried drafts into a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0  # decode steps that verified drafts (not exported)
        # [k]: how often the draft at position i (0-based) was accepted
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify row: the accepted drafts plus the token the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
