"""StepLauncher: schedule a step, plan it, send it to the runners, and post its grammar masks.

What it launches is a `LaunchedStep`: the scheduled sequences and the future of the runners'
result. Launching advances the scheduler as if the step had already run (its sequences'
tokens count as computed, the token it samples as pending), so the next step can be launched
before this one's result arrives (async scheduling); the engine folds results in, in order.

Grammar masks: where the executor takes them late (in-process, `post_masks`), a plan names its
constrained rows and `post_masks` sends their masks, computed on the MaskWorker's threads, as
soon as every earlier step was collected (the engine calls it then; before it waits for the
step at the latest). Elsewhere (shard executors) they are computed at plan time, which needs
every earlier token: such batches step serially.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from raylane.actors.engine.grammar import GrammarCompiler
from raylane.actors.engine.mask_worker import MaskWorker
from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.planner import StepPlanner
from raylane.actors.engine.postprocessor import Postprocessor
from raylane.actors.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.spec.speculation import Speculation
from raylane.actors.engine.stats import EngineStats, StepTimer
from raylane.actors.executor.base import Executor
from raylane.actors.runner.faults import Faults
from raylane.actors.runner.plan import StepResult


@dataclass
class LaunchedStep:
    """A step on its way to the runners."""

    scheduled: list[ScheduledSeq]  # its flat order, as scheduled
    future: Future[StepResult]
    timer: StepTimer
    step_id: int = -1
    late: dict[int, Sequence] = field(default_factory=dict)  # rows whose masks follow
    ahead: bool = False  # launched while the step before it ran (async scheduling)


class StepLauncher:
    def __init__(
        self,
        scheduler: Scheduler,
        planner: StepPlanner,
        executor: Executor,
        grammars: GrammarCompiler,
        post: Postprocessor,
        stats: EngineStats,
        speculation: Speculation,
    ):
        self.scheduler = scheduler
        self.planner = planner
        self.executor = executor
        self.grammars = grammars
        self._post_late = getattr(executor, "post_masks", None)
        self.masks = MaskWorker(grammars.vocab_size) if self._post_late else None
        self.post = post
        self.stats = stats
        self.faults = Faults()  # the "plan" stage; tests arm it (tests/support/faults.py)
        self.failed: list[EngineCoreOutput] = []  # outputs of requests whose plan raised
        self.speculation = speculation  # drafts the decode rows of each batch it launches

    def launch(self) -> LaunchedStep | None:
        """Schedule, plan and submit a step (None when there is nothing to run)."""
        timer = StepTimer()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.planner.preempted(batch.preempted)
            return None
        self._record_scheduled(batch)
        self.speculation.draft(batch)
        timer.mark("schedule")
        try:
            self.faults.check("plan")
            late = self._late_rows(batch)
            plan = self.planner.plan(batch, None if late else self._token_masks(batch))
            if late:
                plan = dataclasses.replace(plan, late_masks=tuple(late))
        except Exception as e:  # its requests fail; the engine goes on
            self.planner.preempted(batch.preempted)
            self.failed += self.post.fail(batch.scheduled, e)
            return None
        timer.mark("plan")
        future = self.executor.submit(plan)
        for item in batch.scheduled:
            self.scheduler.launched(item)
        return LaunchedStep(batch.scheduled, future, timer, plan.step_id, late)

    def post_masks(self, step: LaunchedStep | None) -> None:
        """Send the step's late masks (once); call when every earlier step was collected."""
        if step is None or not step.late or self.masks is None or self._post_late is None:
            return
        self._post_late(step.step_id, self.masks.masks(step.late))
        step.late = {}

    def constrained(self) -> bool:
        """A running sequence follows a grammar and its masks go in the plan: its next mask
        needs its token in flight (serial steps)."""
        return self.masks is None and any(s.matcher is not None for s in self.scheduler.running)

    def _late_rows(self, batch: SchedulerOutput) -> dict[int, Sequence]:
        """The constrained rows that sample, by seq_id, where masks are posted late."""
        if self.masks is None:
            return {}
        seqs = [item.seq for item in batch.scheduled if item.samples]
        return {s.seq_id: s for s in seqs if s.matcher is not None}

    def _token_masks(self, batch: SchedulerOutput) -> dict[int, object]:
        """The grammar masks of the step's constrained rows that sample, by seq_id."""
        seqs = [item.seq for item in batch.scheduled if item.samples]
        matchers = {s.seq_id: s.matcher for s in seqs if s.matcher is not None}
        if not matchers:
            return {}
        return dict(zip(matchers, self.grammars.masks(list(matchers.values()))))

    def _record_scheduled(self, batch: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in batch.scheduled:
            request = self.post.requests[item.seq.request_id]
            self.stats.scheduled(request, item.seq.num_prompt_tokens, now)
