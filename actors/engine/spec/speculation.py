"""Speculation: what the engine's step asks of speculative decoding, as one component.

The launcher asks it to draft a scheduled batch before the batch is planned; the pipeline asks
whether the step after the due one must wait for it, and tells it each step's times; the
postprocessor hands it each row's verified result and the sequences that finished. `Drafter`
speculates; `NoSpeculation` is the answer when `EngineConfig.spec` is None, so no caller
tests for None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from raylane.actors.engine.spec.drafter import Drafter
from raylane.actors.engine.spec.metrics import SpecStats

if TYPE_CHECKING:
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.engine.config import EngineConfig
    from raylane.actors.engine.scheduler import ScheduledSeq, SchedulerOutput
    from raylane.actors.engine.sequence import Sequence
    from raylane.actors.engine.stats import EngineStats
    from raylane.actors.runner.plan import StepResult


class Speculation(Protocol):
    def draft(self, batch: SchedulerOutput) -> None:
        """Give the batch's decode rows their drafts (and their slots), before it is planned."""

    def plans_serially(self, due: list[ScheduledSeq], running: list[Sequence]) -> bool:
        """The step after the due step (`due`: its rows) waits for it to return."""

    def verified(self, item: ScheduledSeq, result: StepResult, row: int) -> None:
        """Fold in what the step's row `row` (`item`, its tokens appended) verified."""

    def observe(
        self, scheduled: list[ScheduledSeq], timings: dict[str, float], ahead: bool
    ) -> None:
        """A collected step's runner timings (`ahead`: planned while the step before ran)."""

    def forget(self, seq: Sequence) -> None:
        """The sequence finished: drop what is kept for it."""


class NoSpeculation:
    """Speculation off: no drafts, nothing holds a step back, nothing to fold in."""

    def draft(self, batch: SchedulerOutput) -> None:
        pass

    def plans_serially(self, due: list[ScheduledSeq], running: list[Sequence]) -> bool:
        return False

    def verified(self, item: ScheduledSeq, result: StepResult, row: int) -> None:
        pass

    def observe(
        self, scheduled: list[ScheduledSeq], timings: dict[str, float], ahead: bool
    ) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


def speculation_for(config: EngineConfig, blocks: BlockManager, stats: EngineStats) -> Speculation:
    """The engine's speculation: a `Drafter` counting into `stats.spec`, or `NoSpeculation`."""
    spec = config.spec
    if spec is None:
        return NoSpeculation()
    stats.spec = SpecStats(spec.num_speculative_tokens)
    return Drafter(spec, blocks, config.max_num_batched_tokens, config.max_model_len, stats.spec)
