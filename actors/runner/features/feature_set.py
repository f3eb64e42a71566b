"""`RunnerFeatures`: the features one runner built (in registry order), and each hook called
over all of them; what the runner asks of them (memory, graphs, ranks that draw) reduced to
one answer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from raylane.actors.runner.features.base import Runner, RunnerFeature

if TYPE_CHECKING:
    from raylane.actors.runner.inputs import StepInputs
    from raylane.actors.runner.plan import StepPlan, StepResult
    from raylane.actors.runner.requests import ScheduledRequest

F = TypeVar("F", bound=RunnerFeature)


class RunnerFeatures:
    def __init__(self, runner: Runner, classes: Iterable[type[RunnerFeature]]) -> None:
        """Build each of `classes` that is enabled for the runner's config and model."""
        self.runner = runner
        self.active = [cls(runner) for cls in classes if cls.enabled(runner.config, runner.model)]

    def __iter__(self) -> Iterator[RunnerFeature]:
        return iter(self.active)

    def find(self, kind: type[F]) -> F | None:
        return next((f for f in self.active if isinstance(f, kind)), None)

    def attach(self, kind: type[RunnerFeature]) -> None:
        """Build `kind` on this running runner (after the others; none if one of its name is
        there): how a test reaches a runner another process built. It sees only the steps
        from now on, and none of the construction-time hooks (memory, models, graphs)."""
        if all(f.name != kind.name for f in self.active):
            self.active.append(kind(self.runner))

    def call(self, name: str, method: str, *args: Any) -> Any:
        """`method` of the feature called `name` (an executor's `collective_rpc` reaches it as
        "features.call")."""
        for feature in self.active:
            if feature.name == name:
                return getattr(feature, method)(*args)
        raise ValueError(f"name: this runner has no feature {name!r}")

    # --- the step -----------------------------------------------------------------------------

    def before_prepare(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        self._each("before_prepare", plan, scheduled)

    def before_forward(
        self, plan: StepPlan, scheduled: list[ScheduledRequest], step: StepInputs
    ) -> None:
        self._each("before_forward", plan, scheduled, step)

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        self._each("after_forward", plan, scheduled, step, hidden, routed)

    def after_logits(
        self, scheduled: list[ScheduledRequest], step: StepInputs, logits: torch.Tensor
    ) -> torch.Tensor:
        for feature in self.active:
            logits = feature.after_logits(scheduled, step, logits)
        return logits

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        self._each("after_sampling", plan, scheduled, step, result)

    def after_step(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        self._each("after_step", plan, scheduled, step, result)

    def forget(self, seq_ids: tuple[int, ...]) -> None:
        if seq_ids:
            self._each("forget", seq_ids)

    # --- what the runner asks of them ---------------------------------------------------------

    def draws_on_every_rank(self, step: StepInputs) -> bool:
        return any(f.draws_on_every_rank(step) for f in self.active)

    def allows_graph_replay(self) -> bool:
        return all(f.allows_graph_replay() for f in self.active)

    def allows_verify_graphs(self) -> bool:
        return all(f.allows_verify_graphs() for f in self.active)

    def kv_bytes_per_token(self) -> int:
        return sum(f.kv_bytes_per_token() for f in self.active)

    def kv_reserved_bytes(self) -> int:
        return sum(f.kv_reserved_bytes() for f in self.active)

    def extra_models(self) -> list[Any]:
        return [model for f in self.active for model in f.extra_models()]

    def info(self) -> dict[str, Any]:
        return {key: value for f in self.active for key, value in f.info().items()}

    def weight_checksums(self) -> dict[str, str]:
        return {key: value for f in self.active for key, value in f.weight_checksums().items()}

    # --- upkeep -------------------------------------------------------------------------------

    def kv_allocated(self, num_blocks: int) -> None:
        self._each("kv_allocated", num_blocks)

    def on_sleep(self, level: int) -> None:
        self._each("on_sleep", level)

    def on_wake(self) -> None:
        self._each("on_wake")

    def on_weights(self) -> None:
        self._each("on_weights")

    def _each(self, hook: str, *args: Any) -> None:
        for feature in self.active:
            getattr(feature, hook)(*args)
