"""Per-sequence backoff: a sequence whose drafts keep failing stops drafting for a while.

Verifying a draft costs forward work on every row it adds, and a step that drafts is planned
only after the step before it returned (no async overlap); on text the proposers cannot
predict (random text) almost every draft is rejected. So a sequence whose last draft had no
accepted token skips the next 1, 2, 4, ... steps (up to `max_skip`), and one accepted token
resets it. Plain bookkeeping per seq_id, on a step clock (`tick`) that runs whether or not
the sequence could draft at a step (async steps, where its last token is in flight).
"""

from __future__ import annotations


class Backoff:
    def __init__(self, max_skip: int = 16):
        self.max_skip = max_skip
        self.step = 0
        self._skip: dict[int, int] = {}  # seq_id -> steps to skip after the next failure
        self._resume: dict[int, int] = {}  # seq_id -> the step from which it may draft again

    def tick(self) -> None:
        """One engine step was planned."""
        self.step += 1

    def ready(self, seq_id: int) -> bool:
        return self.step >= self._resume.get(seq_id, 0)

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        if num_accepted > 0:
            self._skip.pop(seq_id, None)
            return
        skip = self._skip.get(seq_id, 1)
        self._resume[seq_id] = self.step + skip + 1  # recorded before the next step's tick
        self._skip[seq_id] = min(2 * skip, self.max_skip)

    def forget(self, seq_id: int) -> None:
        self._skip.pop(seq_id, None)
        self._resume.pop(seq_id, None)


# lookups that found nothing worth sending back off only where they took more than this
# share of the step they prepare (at batch 1 a lookup is ~0.1 % of the step: always tried)
LOOKUP_SHARE = 0.01


class LookupBackoff(Backoff):
    """The batch's lookups (one key, 0): a step whose lookups found nothing that pays (no
    match, a match cut to no position by its class, or drafts not worth the verify step) and
    took over LOOKUP_SHARE of the step skips the lookups of the next 1, 2, 4 .. 16 steps (one
    that paid resets it). Lookups cost host time whether or not drafts follow, and it is the
    engine thread's, which the runner thread waits on for the GIL: on random text at batch 32,
    n-gram lookups that found nothing made every step 10 % longer."""

    def after_step(self, paid: bool, seconds: float, step_s: float | None) -> None:
        """The lookups took `seconds` for a step the cost model predicts at `step_s` (None:
        not fitted yet, counted as costly)."""
        if paid or step_s is None or seconds > LOOKUP_SHARE * step_s:
            self.record(0, 1, int(paid))
