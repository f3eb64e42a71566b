"""MaskBoard: the in-process runner's grammar masks, posted by the engine after the plan.

A constrained step leaves the engine before its masks exist: with async scheduling step N+1
is planned while N runs, and N+1's masks need N's tokens. Its plan names the rows whose masks
follow (`StepPlan.late_masks`); the engine posts one future per row as soon as those rows'
grammars have taken every earlier token (a grammar thread computes them, without the GIL,
while the forward runs), and the runner takes them after its forward pass.

The worst case is bounded per row: a mask still being computed `wait_s` after the forward
(a pathological grammar state) does not hold the batch. Its row is skipped: it samples
nothing this step and recomputes its last position at the next one (same input, same
position, so the same logits and the same seeded draw), while the other rows go on. When no
other row of the step samples, there is nothing to hold, and the step waits for it. Only
decode rows are skipped; a prompt's last chunk waits (it would redo a prefill).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait

from raylane.actors.runner.plan import StepPlan
from raylane.actors.runner.requests import ScheduledRequest

SKIP = object()  # in a step's masks: the row's mask was late, it samples nothing
POST_TIMEOUT_S = 600.0  # the engine posts every step it sent; past this it is gone


class MaskBoard:
    def __init__(self, wait_s: float = 0.05):
        self.wait_s = wait_s  # how long past its forward a step waits for a late row
        self._posted: dict[int, dict[int, Future]] = {}
        self._changed = threading.Condition()
        self._closed = False

    def post(self, step_id: int, masks: dict[int, Future]) -> None:
        """The step's masks by seq_id (futures of int32 bit sets [ceil(vocab / 32)] or None
        for no constraint); called once per step whose plan has late masks."""
        with self._changed:
            self._posted[step_id] = masks
            self._changed.notify_all()

    def close(self) -> None:
        """The executor shuts down: a runner waiting for a post gives up (no hang at exit)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self, step_id: int, skippable: set[int], num_sampling: int) -> dict[int, object]:
        """The step's masks (SKIP for a skipped row). Late rows are skipped when all of them
        are in `skippable` and some other of the step's `num_sampling` rows samples."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: step_id in self._posted or self._closed, POST_TIMEOUT_S
            ):
                raise RuntimeError(f"step {step_id}: its grammar masks were never posted")
            if step_id not in self._posted:
                raise RuntimeError(f"step {step_id}: the executor shut down")
            futures = self._posted.pop(step_id)
            for old in [s for s in self._posted if s < step_id]:  # steps that failed early
                del self._posted[old]
        _, late = wait(futures.values(), timeout=self.wait_s)
        late_ids = {seq_id for seq_id, f in futures.items() if f in late}
        if late_ids and (late_ids - skippable or len(late_ids) >= num_sampling):
            wait(futures.values())  # nobody to hold, or a row that may not skip: wait
            late_ids = set()
        return {s: SKIP if s in late_ids else f.result() for s, f in futures.items()}


def step_masks(
    board: MaskBoard | None,
    plan: StepPlan,
    scheduled: list[ScheduledRequest],
    can_skip: bool = True,
) -> dict[int, object]:
    """The step's masks by seq_id: those in its plan, then the late ones from the board.
    `can_skip=False` waits for every late mask: a model with recurrent state (linear
    attention) cannot compute a position twice, so no row may skip and redo it."""
    masks: dict[int, object] = dict(plan.token_masks)
    if not plan.late_masks:
        return masks
    if board is None:
        raise RuntimeError("a plan with late grammar masks, but this runner has no MaskBoard")
    sampling = [item for item in scheduled if item.samples]
    # a decode row may skip: redoing it recomputes one position
    skippable = {
        item.state.seq_id for item in sampling if can_skip and item.num_new == 1 and not item.drafts
    }
    masks.update(board.take(plan.step_id, skippable, len(sampling)))
    return masks


def roll_back_skipped(scheduled: list[ScheduledRequest], masks: dict[int, object]) -> list[int]:
    """After the step's bookkeeping: each skipped row's last position is to be computed again
    (its KV there is right, but its logits were not sampled). Returns their seq_ids."""
    skipped = []
    for item in scheduled:
        if masks.get(item.state.seq_id) is SKIP:
            item.state.skip_last()
            skipped.append(item.state.seq_id)
    return skipped
