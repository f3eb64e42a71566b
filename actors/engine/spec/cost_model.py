"""CostModel: is a draft token worth verifying in this batch? Measured, not configured.

The forward pass of a step with T query tokens takes about a + b * T seconds (a: reading the
weights and fixed costs; b: the compute each token adds); both are fitted online, by least
squares over recent decode and verify steps (decayed sums, so the fit follows the load). A
step of B sampling rows and T tokens yields B tokens, each worth (a + b * T) / B seconds; a
draft token at position j costs b and yields a token with probability P(accepted > j). So it
pays when P(accepted > j) > b * B / (a + b * T): close to 0 at batch 1 where the weights'
reads dominate, close to 1 in large compute-bound batches. Until the fit has data, every
draft is worth it (that is what gives the fit verify steps of more tokens to learn b from).
"""

from __future__ import annotations

MIN_STEPS = 16  # observations before the fit is trusted
WARMUP_STEPS = 4  # first observations dropped (first runs of a shape are slow)


class CostModel:
    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return
        d = self.decay
        self.n = d * self.n + 1
        self.sx = d * self.sx + num_tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + num_tokens * num_tokens
        self.sxy = d * self.sxy + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with a, b >= 0, or None while the data cannot tell them apart."""
        spread = self.n * self.sxx - self.sx * self.sx
        if self.steps < WARMUP_STEPS + MIN_STEPS or spread <= 1e-9 * max(1.0, self.n * self.sxx):
            return None
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / spread)
        a = max(0.0, (self.sy - b * self.sx) / self.n)
        return a, b

    def threshold(self, num_rows: int, num_tokens: int) -> float:
        """The acceptance probability a draft token needs to pay for itself in a step of
        `num_rows` sampling rows and `num_tokens` query tokens (before drafts)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        a, b = fit
        step = a + b * num_tokens
        return b * num_rows / step if step > 0 else 0.0
