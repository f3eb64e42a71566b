"""Injected failures, a test hook: make the next step fail at a chosen stage.

`arm(stage)` makes the next `check(stage)` raise `InjectedFault` (`times` checks in a row).
The engine checks "plan" while it plans a step (`StepLauncher.faults`); the runners check
"prepare" and "forward" only where a test attached its fault feature (tests/support/faults.py:
`arm_fault`, which arms the engine or every runner).
"""

from __future__ import annotations

STAGES = ("plan", "prepare", "forward")


class InjectedFault(RuntimeError):
    """A failure a test asked for."""


class Faults:
    def __init__(self) -> None:
        self._armed: dict[str, int] = {}

    def arm(self, stage: str, times: int = 1) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: {stage!r} is not one of {list(STAGES)}")
        if not isinstance(times, int) or times < 0:
            raise ValueError(f"times must be an int >= 0, got {times!r}")
        self._armed[stage] = times

    def check(self, stage: str) -> None:
        left = self._armed.get(stage, 0)
        if left:
            self._armed[stage] = left - 1
            raise InjectedFault(f"injected fault in {stage}")
