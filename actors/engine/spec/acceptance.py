"""Acceptance: how often the target accepts drafts, per match class and draft position.

A proposal's class is the length of the match its drafts follow (1, 2, 3, 4+ tokens; a draft
model's and MTP's drafts count as 1): on free text a 1-token suffix match is mostly wrong, a
4-token one mostly right, so one rate for all would either draft the bad ones or drop the good
ones. Per class and position j the table keeps the drafts that reached j (`offered`) and those
accepted through j (`hit`), decayed by 0.99 per drafted row, so it follows the workload.

`rate(cls, j)` = P(accepted > j) = (hit + prior) / (offered + 1), the prior being the rate of
all classes pooled, (hit + 1) / (offered + 1) summed over classes: a class never seen (no
4-token match on random text) takes what the others measured instead of staying optimistic.
Decode steps that draft nothing `fade` every count by 0.999, so once nothing refreshes them
the prior wins again and drafting is tried anew (a workload that turns repetitive).
"""

from __future__ import annotations

NUM_CLASSES = 4
DECAY = 0.99  # per drafted row of the class
# per decode step that drafted nothing. Slowly: while any class pays, every decoding row is
# looked up each step, and on random text at batch 16 those lookups (the suffix index
# catching up) cost 3 % of the step time when 0.99 made them come back within ~100 steps.
IDLE_DECAY = 0.999


def match_class(match: int) -> int:
    """The class of a proposal following a match of `match` tokens."""
    return min(max(match, 1), NUM_CLASSES) - 1


class AcceptanceTable:
    def __init__(self, k: int):
        self.k = k
        self.offered = [[0.0] * k for _ in range(NUM_CLASSES)]
        self.hit = [[0.0] * k for _ in range(NUM_CLASSES)]
        self._rates: list[list[float]] | None = None  # [j][class], until the counts change

    def rate(self, cls: int, j: int) -> float:
        """P(accepted > j) for a draft of class `cls` that reached position j."""
        if self._rates is None:
            self._rates = [self._rates_at(pos) for pos in range(self.k)]
        return self._rates[j][cls]

    def _rates_at(self, j: int) -> list[float]:
        hit, offered = sum(row[j] for row in self.hit), sum(row[j] for row in self.offered)
        pooled = (hit + 1) / (offered + 1)
        return [(h[j] + pooled) / (o[j] + 1) for h, o in zip(self.hit, self.offered)]

    def depths(self, threshold: float) -> list[int]:
        """Per class: how many leading positions have a rate above `threshold`."""
        depths = []
        for cls in range(NUM_CLASSES):
            j = 0
            while j < self.k and self.rate(cls, j) > threshold:
                j += 1
            depths.append(j)
        return depths

    def expected(self, drafts: list[tuple[int, int]]) -> float:
        """Accepted tokens expected of drafts of these (class, length)s."""
        return sum(self.rate(cls, j) for cls, n in drafts for j in range(n))

    def record(self, cls: int, num_drafts: int, num_accepted: int) -> None:
        offered, hit = self.offered[cls], self.hit[cls]
        for j in range(self.k):
            offered[j] = DECAY * offered[j] + (j < num_drafts)
            hit[j] = DECAY * hit[j] + (j < num_accepted)
        self._rates = None

    def fade(self) -> None:
        """A decode step drafted nothing: every count weighs less against the prior."""
        for rows in (self.offered, self.hit):
            for row in rows:
                row[:] = [IDLE_DECAY * x for x in row]
        self._rates = None
