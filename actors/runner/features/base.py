"""`RunnerFeature`: one optional part of a step (a draft model, MTP, linear-attention state,
grammar masks, ...) behind hooks the `ModelRunner` calls at fixed points of every step and of
its upkeep. Every hook is a no-op here; a feature overrides the ones it needs.

The step, in the order the runner calls the hooks (every rank calls them all; `result` is None
on the ranks that do not report):

    apply the plan       -> forget(finished seq_ids)
    before_prepare       (the plan's rows, before their input tensors exist)
    prepare the inputs   -> before_forward
    forward              -> after_forward(hidden, routed)  (hidden None after a graph replay)
                         -> after_logits(logits)  -> logits
    sample               -> after_sampling(result)
    bookkeeping          -> after_step(result)

Construction (`__init__(runner)`) comes after the model is loaded and before the KV cache is
allocated (a feature may take memory out of its budget: `kv_bytes_per_token`,
`kv_reserved_bytes`): the runner then has `model`, `hf_config`, `config`, `tp`, `device`,
`dtype`, `weights`, `inputs` and `sampler`; `kv` exists from `kv_allocated` on (read it from the
runner in each hook: a wake-up replaces it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from raylane.actors.models import TPGroup
    from raylane.actors.runner.config import RunnerConfig
    from raylane.actors.runner.inputs import InputPreparer, StepInputs
    from raylane.actors.runner.kv_cache import KVCache
    from raylane.actors.runner.mask_board import MaskBoard
    from raylane.actors.runner.plan import StepPlan, StepResult
    from raylane.actors.runner.requests import ScheduledRequest
    from raylane.actors.runner.sampler import Sampler
    from raylane.actors.runner.weight_updates import RunnerWeights


class Runner(Protocol):
    """What a feature reads of the `ModelRunner` that builds it (model_runner.py): a protocol,
    so the features never import the runner that imports them."""

    @property
    def config(self) -> RunnerConfig: ...
    @property
    def model(self) -> Any: ...  # the architecture's class (attention_layers, ...)
    @property
    def hf_config(self) -> Any: ...
    @property
    def tp(self) -> TPGroup: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def weights(self) -> RunnerWeights: ...
    @property
    def inputs(self) -> InputPreparer: ...
    @property
    def sampler(self) -> Sampler: ...
    @property
    def kv(self) -> KVCache: ...  # from `kv_allocated` on
    @property
    def mask_board(self) -> MaskBoard | None: ...


class RunnerFeature:
    """One optional part of the runner; the registry (features/__init__.py) lists the classes,
    and the runner builds the ones whose `enabled` holds for its config and model."""

    name = "feature"  # how `RunnerFeatures.call` finds it

    @classmethod
    def enabled(cls, config: RunnerConfig, model: Any) -> bool:
        """Whether a runner of `config` over `model` (the loaded architecture) needs it."""
        return False

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    # --- the step -----------------------------------------------------------------------------

    def before_prepare(self, plan: StepPlan, scheduled: list[ScheduledRequest]) -> None:
        """The step's rows, before their input tensors are built (a row's drafts may change)."""

    def before_forward(
        self, plan: StepPlan, scheduled: list[ScheduledRequest], step: StepInputs
    ) -> None:
        """The step's tensors exist; set what the forward reads (e.g. per-token buffers that
        a graph replay reads too)."""

    def after_forward(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor | None,
        routed: torch.Tensor | None,
    ) -> None:
        """hidden [T, H] of an eager forward (None after a graph replay: see
        `allows_graph_replay`), routed [T, num_moe_layers, top_k] or None."""

    def after_logits(
        self, scheduled: list[ScheduledRequest], step: StepInputs, logits: torch.Tensor
    ) -> torch.Tensor:
        """logits [rows, vocab] (scheduled[i]'s rows: `step.logits_rows[i]`) -> the logits
        sampling and logprobs see (modified in place or new)."""
        return logits

    def after_sampling(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        """The step's tokens are drawn (`state.last_sampled` on the ranks that draw them), the
        request states not yet advanced; `result` is the reporting rank's, else None."""

    def after_step(
        self,
        plan: StepPlan,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        result: StepResult | None,
    ) -> None:
        """After the step's bookkeeping (the computed tokens counted)."""

    def forget(self, seq_ids: Iterable[int]) -> None:
        """These sequences finished or were aborted. (A preempted one keeps what a feature
        holds for it: it comes back as a cached request, its `NewRequest` never sent again.)"""

    # --- what the runner asks of it -----------------------------------------------------------

    def draws_on_every_rank(self, step: StepInputs) -> bool:
        """Every rank must draw this step's tokens (not only the reporting one)."""
        return False

    def allows_graph_replay(self) -> bool:
        """False: every forward runs eagerly (e.g. a feature that reads `hidden`)."""
        return True

    def allows_verify_graphs(self) -> bool:
        """False: verify rows never replay (their forward needs host-side work)."""
        return True

    def kv_bytes_per_token(self) -> int:
        """Bytes per token that each KV block pays for besides the target's (a pool of its own
        over the same block ids)."""
        return 0

    def kv_reserved_bytes(self) -> int:
        """Bytes taken out of the KV cache's budget before it is divided into blocks."""
        return 0

    def extra_models(self) -> list[Any]:
        """Networks it runs beside the target: they get the same attention backend and fused
        ops, sleep with it (KV released, weights spilled) and wake with it."""
        return []

    def info(self) -> dict[str, Any]:
        """`RunnerInfo` fields it reports."""
        return {}

    def weight_checksums(self) -> dict[str, str]:
        """Checksums of its own parameters, by the names a weight update gives them."""
        return {}

    # --- upkeep -------------------------------------------------------------------------------

    def kv_allocated(self, num_blocks: int) -> None:
        """The KV cache of `num_blocks` blocks was allocated (at start, and again on wake-up)."""

    def on_sleep(self, level: int) -> None:
        """The runner released its KV cache (level 1) or its weights too (level 2)."""

    def on_wake(self) -> None:
        """The runner is whole again (weights and KV cache back, graphs captured)."""

    def on_weights(self) -> None:
        """The target's weights changed: a load, a committed update, or a reset."""
