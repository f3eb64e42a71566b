"""StepPipeline: the engine's launched steps, from launch to the outputs folded in.

Serial: launch a step, wait for it, fold its result in. With async scheduling the step after
it is launched (planned on the assumption that every running sequence goes on) before its
result is waited for, so the runners never wait for the engine's bookkeeping; one step is then
in flight between calls.
"""

from __future__ import annotations

from concurrent.futures import Future

from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.outputs import EngineCoreOutput
from raylane.actors.engine.postprocessor import Postprocessor
from raylane.actors.engine.scheduler import Scheduler
from raylane.actors.engine.spec.speculation import Speculation
from raylane.actors.engine.stats import EngineStats
from raylane.actors.engine.step_launcher import LaunchedStep, StepLauncher
from raylane.actors.executor.base import StepFailed
from raylane.actors.runner.plan import StepResult


class StepPipeline:
    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        launcher: StepLauncher,
        post: Postprocessor,
        stats: EngineStats,
        speculation: Speculation,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.launcher = launcher
        self.post = post
        self.stats = stats
        self.speculation = speculation
        self._in_flight: LaunchedStep | None = None  # launched, to be collected by a later step
        self._due: LaunchedStep | None = None  # launched, to be collected by this step
        self._held: list[EngineCoreOutput] = []  # outputs of steps drained outside step()

    def begin_step(self, plan_ahead: bool = True) -> Future[StepResult] | None:
        """Launch what is due; returns the future `end_step` will wait for (None: nothing to
        wait for). `plan_ahead=False` leaves launching the step after it to `plan_ahead()`."""
        if self._in_flight is None:
            self._in_flight = self.launcher.launch()
        self._due, self._in_flight = self._in_flight, None
        self.launcher.post_masks(self._due)  # every step before it was collected
        if plan_ahead:
            self.plan_ahead()
        return None if self._due is None else self._due.future

    def plan_ahead(self) -> bool:
        """With async scheduling, launch the step after the one due while that one runs (once;
        True if it launched one). Constrained batches plan ahead too where the executor takes
        grammar masks after the plan (in-process: see StepLauncher); elsewhere a grammar's
        next mask needs the token in flight, so they step serially. So do batches that
        speculate: drafts need the token in flight, and how many of the due step's drafts
        survive is unknown until it returns (docs/speculative_decoding.md)."""
        if (
            self._due is None
            or self._in_flight is not None
            or not self.config.async_scheduling
            or self.launcher.constrained()
            or self.speculation.plans_serially(self._due.scheduled, self.scheduler.running)
        ):
            return False
        self._in_flight = self.launcher.launch()
        if self._in_flight is None:
            return False
        self._in_flight.ahead = True
        self.stats.steps_planned_ahead += 1
        return True

    def end_step(self) -> list[EngineCoreOutput]:
        """Fold in the step begin_step launched (if drain has not)."""
        outputs, self._held = self._held + self.launcher.failed, []
        self.launcher.failed = []
        due, self._due = self._due, None
        return outputs if due is None else outputs + self._collect(due)

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for every step in flight and fold them in, planning nothing new; returns their
        outputs."""
        outputs = self.end_step()
        if self._in_flight is not None:
            self._due, self._in_flight = self._in_flight, None
            outputs += self.end_step()
        return outputs

    @property
    def holds_outputs(self) -> bool:
        return bool(self._held)

    def hold(self, outputs: list[EngineCoreOutput]) -> None:
        """Outputs made between steps (a weight update's stale ends): the next end_step's."""
        self._held += outputs

    def quiesce(self) -> None:
        """No step in flight from here on; its outputs come with the next end_step()."""
        self._held = self.drain()

    def _collect(self, step: LaunchedStep) -> list[EngineCoreOutput]:
        """Wait for a launched step and fold its result in, then send the grammar masks of
        the step after it (its forward is running)."""
        self.launcher.post_masks(step)
        try:
            result = step.future.result()
        except StepFailed as e:  # the runners dropped its requests and serve on
            self.launcher.post_masks(self._in_flight)
            return self.post.fail(step.scheduled, e)
        step.timer.mark("execute")
        outputs = self.post.apply(step.scheduled, result)
        step.timer.mark("postprocess")
        self.stats.step_times.add(step.timer, result.timings)
        self.speculation.observe(step.scheduled, result.timings, step.ahead)
        self.stats.graph_replays += result.graph_replayed
        self.stats.verify_graph_replays += result.verify_graph_replayed
        self.launcher.post_masks(self._in_flight)
        return outputs
