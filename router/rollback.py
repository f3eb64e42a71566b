"""Where a turn's messages attach to the stored conversation: append, or roll back first.

An agent that retries a turn resends the conversation up to the retried point, so its messages
diverge from (or stop short of) what is stored. The turn then attaches at the latest checkpoint
inside the common prefix — the end of a reply the model generated; assistant messages the client
injected are not checkpoints — and the generated turns after it are discarded. Planning never
mutates: the registry commits the plan only once the turn has been generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.router.errors import RollbackTooDeep
from raylane.router.messages import Message, check_new_roles, common_prefix_len
from raylane.router.trajectory import Trajectory


@dataclass(frozen=True)
class TurnPlan:
    keep: int  # records kept: the checkpoint the turn attaches to (0 = the empty session)
    discarded: int  # generated turns the turn rolls back
    new_messages: list[Message]  # rendered after the checkpoint


def plan_turn(trajectory: Trajectory, incoming: list[Message], max_rollback_steps: int) -> TurnPlan:
    """Raises `RollbackTooDeep` or `BadRole`; the trajectory is left as it is either way."""
    ends = trajectory.checkpoint_ends()
    common = common_prefix_len(trajectory.messages(), incoming)
    # the latest checkpoint inside the common prefix (the last one when nothing diverged)
    keep = max(i for i, end in enumerate(ends) if end <= common)
    discarded = len(trajectory) - keep
    if discarded > max_rollback_steps:
        raise RollbackTooDeep(discarded, max_rollback_steps)
    new = incoming[ends[keep] :]
    check_new_roles(new, continuing=keep > 0)
    return TurnPlan(keep, discarded, new)
