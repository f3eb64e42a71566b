"""One ModelRunner per tensor-parallel rank: owns its model slice, KV cache, request state and
sampler, and turns a `StepPlan` into a `StepResult`.

Results are made once, on rank 0. Every rank computes the full logits rows (the LM head's
all-gather needs the same rows everywhere), but only rank 0 computes logprobs and reads routed
experts, and only its result goes back to the engine; the other ranks return None. The other
ranks draw tokens only under async scheduling (`RunnerConfig.sample_on_every_rank`), where
each must fill the next plan's placeholders itself: the draws agree, because every rank holds
the same logits and the random words are a function of (seed, stream, position). Otherwise
they skip it, since on a shared CPU that work would slow the whole group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple, cast

import torch
from raylane.actors.models import TPGroup, load_model, load_weights
from raylane.actors.models.layer_layout import layer_groups
from raylane.actors.runner.config import RunnerConfig, RunnerInfo
from raylane.actors.runner.features import FEATURES
from raylane.actors.runner.features.feature_set import RunnerFeatures
from raylane.actors.runner.inputs import InputPreparer, StepInputs
from raylane.actors.runner.kernel_setup import attach_kernels
from raylane.actors.runner.kv_cache import bytes_per_token
from raylane.actors.runner.mask_board import MaskBoard
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import RequestTable, ScheduledRequest
from raylane.actors.runner.result_builder import ResultBuilder
from raylane.actors.runner.runner_upkeep import RunnerUpkeep
from raylane.actors.runner.sampler import Sampler
from raylane.actors.runner.weight_spill import WeightSpill
from raylane.actors.runner.weight_updates import RunnerWeights


class Forward(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] of the rows that need them
    hidden: torch.Tensor | None  # [T, H] of an eager forward; None after a graph replay
    routed: torch.Tensor | None  # [T, num_moe_layers, top_k] or None
    replayed: bool  # a captured graph ran it
    verify_replayed: bool  # ... a verify graph


class ModelRunner(RunnerUpkeep):
    # late grammar masks: the in-process executor hands its board over (mask_board.py)
    mask_board: MaskBoard | None = None

    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device)
        self._load_model(config)
        self.kv_groups = layer_groups(self.model.attention_layers())  # sliding and full apart
        self.inputs = InputPreparer(config.block_size, self.device, self.kv_groups.num_groups)
        self.sampler = Sampler(
            self.hf_config.vocab_size,
            list(config.eos_token_ids),
            self.device,
            config.seed,
            config.batch_invariant,
        )
        self.results = ResultBuilder(self.sampler)  # the sampling rank's StepResult
        self.requests = RequestTable()
        # the optional parts (features/__init__.py), before the KV cache: they may take memory
        self.features = RunnerFeatures(self, FEATURES)
        self.weights.on_commit = self.features.on_weights
        self.nets = [self.model, *self.features.extra_models()]
        self.spills = [WeightSpill() for _ in self.nets]
        attach_kernels(self.nets, config, self.device, self.dtype)
        self._allocate_kv()
        self.graphs = self._graph_runner(config)

    def _load_model(self, config: RunnerConfig) -> None:
        model, hf_config, _ = load_model(
            config.model_dir,
            resolve_dtype(config.dtype, self.device),
            self.device,
            self.tp,
            # the batch-invariant mode runs the packs too, rows padded (batch_invariant/linear.py)
            pack_weights=config.pack_weights,
        )
        # the architecture's class (attention_layers, compute_logits), not a plain nn.Module
        self.model: Any = cast(Any, model)
        self.hf_config = hf_config
        self.dtype = next(model.parameters()).dtype
        self.weights = RunnerWeights(self.model, hf_config, self.tp, self.device)

    @property
    def samples(self) -> bool:
        return self.tp.rank == 0

    def info(self) -> RunnerInfo:
        own = bytes_per_token(self.model.attention_layers(), self.dtype, self.kv_groups)
        per_token = own + self.features.kv_bytes_per_token()
        return RunnerInfo(
            num_kv_blocks=self.kv.num_blocks,
            vocab_size=self.hf_config.vocab_size,
            num_moe_layers=getattr(self.model, "num_moe_layers", 0),
            num_dsa_layers=getattr(self.model, "num_dsa_layers", 0),
            index_topk=getattr(self.model, "index_topk", 0),
            moe_top_k=getattr(self.model, "moe_top_k", 0),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            kv_bytes_per_token=self.tp.world_size * per_token,
            kv_group_windows=self.kv_groups.windows,
            **self.features.info(),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step; the sampling rank returns its result, the others None. When it raises,
        the step's requests are dropped here first (the engine ends them with an error)."""
        try:
            return self._execute(plan)
        except Exception:
            self.requests.fail(plan)
            raise

    def _execute(self, plan: StepPlan) -> StepResult | None:
        """prepare -> forward -> sample -> bookkeeping, the features' hooks between."""
        start = time.perf_counter()
        entries = self.requests.apply(plan)
        self.features.forget(plan.finished_seq_ids)
        scheduled = [item for item in entries if item is not None]
        if not scheduled:
            return StepResult.empty(len(entries)) if self.samples else None
        self.features.before_prepare(plan, scheduled)
        num_prefills = sum(1 for item in entries[: plan.num_prefills] if item is not None)
        step = self.inputs.prepare(scheduled, num_prefills)
        self.features.before_forward(plan, scheduled, step)
        prepared = time.perf_counter()
        out = self._run_forward(step, scheduled)
        self.features.after_forward(plan, scheduled, step, out.hidden, out.routed)
        logits = self.features.after_logits(scheduled, step, out.logits)
        computed = time.perf_counter()
        result = self._sample(scheduled, step, logits)
        self.features.after_sampling(plan, scheduled, step, result)
        self._advance(scheduled, step)
        self.features.after_step(plan, scheduled, step, result)
        if result is None:
            return None
        result.graph_replayed, result.verify_graph_replayed = out.replayed, out.verify_replayed
        if len(scheduled) < len(entries):  # entries of failed requests come back empty
            rows = [i for i, item in enumerate(entries) if item is not None]
            result = result.spread(rows, len(entries))
        result.timings = self._timings(start, prepared, computed)
        return result

    def _run_forward(self, step: StepInputs, scheduled: list[ScheduledRequest]) -> Forward:
        """A decode batch or a verify batch that a graph holds replays it, anything else runs
        eagerly."""
        graphs = self.graphs
        if graphs is not None:
            if graphs.fits(step):
                logits, routed = graphs.run(step)
                return Forward(logits, None, routed, replayed=True, verify_replayed=False)
            sample_rows_only = all(item.num_sample_rows == item.num_new for item in scheduled)
            if graphs.fits_verify(step, sample_rows_only):
                logits, routed = graphs.run_verify(step)
                return Forward(logits, None, routed, replayed=True, verify_replayed=True)
        hidden, routed = self.model(step.input_ids, step.positions, step.attn)
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        return Forward(logits, hidden, routed, replayed=False, verify_replayed=False)

    def _sample(
        self, scheduled: list[ScheduledRequest], step: StepInputs, logits: torch.Tensor
    ) -> StepResult | None:
        """The reporting rank's result. A rank that does not report draws the tokens too
        under async scheduling (it fills placeholders) or where a feature needs every rank
        to feed the same tokens on (MTP layers; a linear-attention state's verify rows)."""
        if self.samples:
            return self.results.result(scheduled, step, logits)
        if self.config.sample_on_every_rank or self.features.draws_on_every_rank(step):
            self.results.draw_only(scheduled, step, logits)
        return None

    def _timings(self, start: float, prepared: float, computed: float) -> dict[str, float]:
        finished = time.perf_counter()
        return {
            "started_at": start,
            "prepare": prepared - start,
            "forward": computed - prepared,
            "sample": finished - computed,
            "collectives": self.tp.clock.take(),
            "finished_at": finished,
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (full, HF-named) checkpoint tensors; each parameter takes its rank's slice."""
        load_weights(self.model, weights)
        self.features.on_weights()

    # weight updates (RL): `self.weights` (RunnerWeights), reached as "weights.<method>";
    # weight checks, sleep and wake-up: RunnerUpkeep's methods

    # --- bookkeeping (every rank) -------------------------------------------------------------

    def _advance(self, scheduled: list[ScheduledRequest], step: StepInputs) -> None:
        for item, (_, count) in zip(scheduled, step.logits_rows):
            item.state.num_prompt_logprobs_done += count - item.num_sample_rows
        RequestTable.advance(scheduled)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"EngineConfig.device: {e}") from None


def resolve_dtype(name: str, device: torch.device) -> str:
    # float32 on CPU: bf16 matmuls are slower there and outputs should match HF exactly;
    # elsewhere "auto" lets the loader take the checkpoint's dtype
    return "float32" if name == "auto" and device.type == "cpu" else name
