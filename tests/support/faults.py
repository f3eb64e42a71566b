"""Injected failures, a test fixture: the next steps of an engine raise at a chosen stage.

"plan" fails a step while the engine plans it (its launcher's `Faults`); "prepare" and
"forward" fail it on every runner, before its input tensors are built or before the model
runs, through `InjectedFaults`: a runner feature defined here, attached to the running
runners (`RunnerFeatures.attach`, over the executor's `collective_rpc`, so it works the same
on the in-process executor and on shard actors). The step's requests end with finish reason
"error"; the engine serves on.
"""

from __future__ import annotations

from typing import Any

from raylane.actors.runner.faults import Faults
from raylane.actors.runner.features import RunnerFeature


class InjectedFaults(RunnerFeature):
    name = "injected_faults"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.faults = Faults()

    def arm(self, stage: str, times: int = 1) -> None:
        self.faults.arm(stage, times)

    def before_prepare(self, plan: Any, scheduled: list) -> None:
        self.faults.check("prepare")

    def before_forward(self, plan: Any, scheduled: list, step: Any) -> None:
        self.faults.check("forward")


def arm_fault(engine: Any, stage: str, times: int = 1) -> None:
    """The next `times` steps of `engine` (an `LLMEngine`) raise at `stage`: "plan",
    "prepare" or "forward". A bad stage or count is a ValueError, before any rank is armed."""
    Faults().arm(stage, times)  # the arguments' check
    if stage == "plan":
        engine.launcher.faults.arm(stage, times)
        return
    engine.executor.collective_rpc("features.attach", InjectedFaults)
    engine.executor.collective_rpc("features.call", InjectedFaults.name, "arm", stage, times)


def arm_replica_fault(replica_actor: Any, stage: str, times: int = 1) -> Any:
    """`arm_fault` on an engine replica's engine, run in the replica actor's process; returns
    the call's ObjectRef."""
    return replica_actor.__ray_call__.remote(_arm_replica, stage, times)


def _arm_replica(replica: Any, stage: str, times: int) -> None:
    arm_fault(replica.engine.engine, stage, times)
