"""Per-sequence backoff: a sequence whose drafts keep failing stops drafting for a while.

Verifying a draft costs forward work on every row it adds; on text the proposers cannot
predict (random text) almost every draft is rejected, so a sequence whose last draft had no
accepted token skips the next 1, 2, 4, ... steps (up to `max_skip`), and one accepted token
resets it. Plain bookkeeping per seq_id.
"""

from __future__ import annotations


class Backoff:
    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self._skip: dict[int, int] = {}  # seq_id -> steps to skip after the next failure
        self._wait: dict[int, int] = {}  # seq_id -> steps left to skip now

    def ready(self, seq_id: int) -> bool:
        """May draft this step (each call while waiting counts one skipped step)."""
        left = self._wait.get(seq_id, 0)
        if left > 0:
            self._wait[seq_id] = left - 1
            return False
        return True

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        if num_accepted > 0:
            self._skip.pop(seq_id, None)
            return
        skip = self._skip.get(seq_id, 1)
        self._wait[seq_id] = skip
        self._skip[seq_id] = min(2 * skip, self.max_skip)

    def forget(self, seq_id: int) -> None:
        self._skip.pop(seq_id, None)
        self._wait.pop(seq_id, None)
