"""Prompt lookup ("ngram"): draft what followed the latest earlier occurrence of the tail."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Matches the last n tokens (n from `max_n` down to `min_n`) of a sequence's own prompt
    and output against earlier positions; the tokens that followed the latest match are the
    drafts (vLLM's prompt lookup, newest match first)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return self.propose_matched(token_ids, k)[0]

    def propose_matched(self, token_ids: list[int], k: int) -> tuple[list[int], int]:
        """(drafts, the length of the match they follow)."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return [], 0
        tokens = np.asarray(token_ids, dtype=np.int64)
        # end positions (exclusive) of earlier occurrences of the last token, newest first
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])[::-1] + 1
        best_n, best_end = 0, 0
        for end in ends.tolist():
            n = _match_len(tokens, end, self.max_n)
            if n > best_n:
                best_n, best_end = n, end
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return [], 0
        return token_ids[best_end : best_end + k], best_n


def _match_len(tokens: np.ndarray, end: int, max_n: int) -> int:
    """How many tokens before `end` equal the sequence's last ones (up to max_n)."""
    n = min(max_n, end)
    a, b = tokens[end - n : end][::-1], tokens[len(tokens) - n :][::-1]
    mismatch = np.flatnonzero(a != b)
    return int(mismatch[0]) if mismatch.size else n
