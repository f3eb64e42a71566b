"""CostModel: does drafting pay in this step? Measured, not configured.

The runner time of a plain decode step with T query tokens is fitted online as a + b * T
(a: reading the weights and fixed costs; b: the compute each token adds), by least squares
over decayed sums of recent steps, so the fit follows the load. A step that verifies drafts
costs that for its tokens plus `c`, the decayed mean of what verify steps took beyond it: on
the CPU their rows take the chunked-prefill path (measured at 2x a decode step at batch 16,
where a + b * T predicted 1.3x). The mean decays on plain steps too, so an estimate that no
verify step refreshed lapses and the next drafts measure it again (one slow verify step in a
load spike does not turn drafting off for good). b is fitted on plain steps only: the draft
count of verify steps varies too little (and their time too much) to tell b from c.

Drafting also costs the async overlap: a step planned after the step before it returned (the
step after a verify step always is, and the step that drafts with known tokens) leaves the
runner idle during the engine's host work (postprocess, schedule, plan), which a step planned
ahead hides. `overlap_s` measures it: the runner's idle gap before serially planned steps
less the gap before steps planned ahead.

A step of B sampling rows and T tokens yields B tokens, each worth (a + b * T) / B seconds.
Drafts pay when the accepted tokens they are expected to add are worth more than their cost:
b per draft token, c for the verify step, and `overlap_s` per serial planning they cause
(`pays`). Per draft position j, a token is worth drafting only while P(accepted > j) exceeds
b * B / (a + b * T) (`threshold`): close to 0 at batch 1 where the weights' reads dominate,
close to 1 in large compute-bound batches. Until measured, drafting pays (that is what gives
the model the verify steps to learn from).
"""

from __future__ import annotations

MIN_STEPS = 16  # plain steps before the fit is trusted
WARMUP_STEPS = 4  # first observations dropped (first runs of a shape are slow)
GAP_SMOOTHING = 0.1


class CostModel:
    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0  # plain steps (tokens, seconds)
        self.steps = self.plain_steps = 0
        self.verify_n = self.verify_excess = 0.0  # verify steps: seconds beyond a + b * T
        self.gaps: dict[bool, float] = {}  # planned ahead? -> smoothed idle gap before a step

    def observe(self, num_tokens: int, seconds: float, verifies: bool = False) -> None:
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return
        d = self.decay
        if verifies:
            fit = self.fit()
            if fit is not None:
                self.verify_n = d * self.verify_n + 1
                excess = seconds - fit[0] - fit[1] * num_tokens
                self.verify_excess = d * self.verify_excess + excess
            return
        self.plain_steps += 1
        # the verify estimate fades too: unrefreshed, it stops counting (`verify_s`), so one
        # slow verify step (a load spike) does not turn drafting off for good
        self.verify_n, self.verify_excess = d * self.verify_n, d * self.verify_excess
        self.n = d * self.n + 1
        self.sx = d * self.sx + num_tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + num_tokens * num_tokens
        self.sxy = d * self.sxy + num_tokens * seconds

    def observe_gap(self, ahead: bool, seconds: float) -> None:
        """The runner's idle time before a step planned ahead (or not) of the one before."""
        last = self.gaps.get(ahead)
        self.gaps[ahead] = seconds if last is None else last + GAP_SMOOTHING * (seconds - last)

    @property
    def overlap_s(self) -> float:
        """What a serially planned step costs over one planned ahead (0 until both seen)."""
        if True not in self.gaps or False not in self.gaps:
            return 0.0
        return max(0.0, self.gaps[False] - self.gaps[True])

    @property
    def verify_s(self) -> float:
        """c: what a verify step costs beyond its tokens (0 until measured, and again once
        the measurements faded below one step's weight)."""
        if self.verify_n < 1.0:
            return 0.0
        return max(0.0, self.verify_excess / self.verify_n)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with a, b >= 0 (b = 0 while every plain step had the same T), or None
        before MIN_STEPS plain steps."""
        if self.plain_steps < MIN_STEPS:
            return None
        spread = self.n * self.sxx - self.sx * self.sx
        b = 0.0
        if spread > 1e-9 * max(1.0, self.n * self.sxx):
            b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / spread)
        a = max(0.0, (self.sy - b * self.sx) / self.n)
        return a, b

    def threshold(self, num_rows: int, num_tokens: int) -> float:
        """The acceptance probability a draft token needs to pay for its own compute in a
        step of `num_rows` sampling rows and `num_tokens` query tokens (before drafts)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        a, b = fit
        step = a + b * num_tokens
        return b * num_rows / step if step > 0 else 0.0

    def pays(
        self, num_rows: int, num_tokens: int, expected: float, num_drafts: int, serial: int
    ) -> bool:
        """Drafts in a step of `num_rows` sampling rows and `num_tokens` query tokens: do
        `expected` accepted tokens pay for `num_drafts` draft tokens, the verify step and
        `serial` steps planned without the async overlap?"""
        fit = self.fit()
        if fit is None:
            return True
        a, b = fit
        worth = (a + b * num_tokens) / max(1, num_rows)
        return expected * worth > b * num_drafts + self.verify_s + serial * self.overlap_s
