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
from typing import Any, cast

import torch
from raylane.actors.models import TPGroup, load_model, load_weights
from raylane.actors.models.layer_layout import layer_groups
from raylane.actors.models.layers import make_batch_invariant
from raylane.actors.runner.config import RunnerConfig, RunnerInfo
from raylane.actors.runner.draft_runner import DraftRunner
from raylane.actors.runner.faults import Faults
from raylane.actors.runner.inputs import InputPreparer, StepInputs
from raylane.actors.runner.kv_cache import KVCache, bytes_per_token
from raylane.actors.runner.mask_board import MaskBoard, roll_back_skipped, step_masks
from raylane.actors.runner.mtp_drafts import attach_draft_probs, mtp_drafts
from raylane.actors.runner.plan import StepPlan, StepResult
from raylane.actors.runner.requests import RequestTable, ScheduledRequest
from raylane.actors.runner.result_builder import ResultBuilder
from raylane.actors.runner.runner_upkeep import RunnerUpkeep
from raylane.actors.runner.sampler import Sampler
from raylane.actors.runner.state_cache import StateCache
from raylane.actors.runner.weight_spill import WeightSpill
from raylane.actors.runner.weight_updates import RunnerWeights
from raylane.kernels.attention import BackendRequest, get_backend
from raylane.kernels.batch_invariant import batch_invariant_backend
from raylane.kernels.fused_ops import attach_fused_ops, get_fused_ops


class ModelRunner(RunnerUpkeep):
    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        model, hf_config, _ = load_model(
            config.model_dir,
            dtype,
            self.device,
            self.tp,
            # the batch-invariant mode runs the packs too, rows padded (batch_invariant/linear.py)
            pack_weights=config.pack_weights,
        )
        # the architecture's class (attention_layers, compute_logits), not a plain nn.Module
        self.model: Any = cast(Any, model)
        self.hf_config = hf_config
        if config.mtp and not len(getattr(self.model, "mtp_layers", ())):
            raise ValueError(
                "EngineConfig.speculative_config.method='mtp': the model has no MTP layers "
                "(num_nextn_predict_layers or mtp_num_hidden_layers in its config, with their "
                "weights in the checkpoint; a checkpoint transformers saved has none)"
            )
        self._hidden: torch.Tensor | None = None
        self.dtype = next(model.parameters()).dtype
        self.weights = RunnerWeights(self.model, hf_config, self.tp, self.device)
        self.spill = WeightSpill()  # a level-2 sleep's weights
        self.draft = (
            DraftRunner(config, self.tp, self.dtype, self.device)
            if config.draft_model_dir is not None
            else None
        )
        if self.draft is not None:  # its tensors ride in the target's updates (draft.<name>)
            self.weights.draft = self.draft.weights
        layers = self.model.attention_layers()
        self._attach_backend([*layers, *(self.draft.layers() if self.draft is not None else [])])
        # RMSNorm, gated activations, RoPE; the batch-invariant mode takes the torch ops, which
        # are a trainer's transformers ops (and reduce within a row)
        fused = get_fused_ops("batch_invariant" if config.batch_invariant else "auto", self.device)
        for net in [self.model, *([self.draft.model] if self.draft is not None else [])]:
            attach_fused_ops(net, fused)
            if config.batch_invariant:
                make_batch_invariant(net)
        linear: list[Any] = getattr(self.model, "linear_layers", list)()
        self.state = (
            StateCache(
                linear, config.num_state_slots, self.dtype, self.device, config.num_state_snapshots
            )
            if linear
            else None
        )
        # the state slots come out of the same memory budget as the KV blocks
        reserved = self.state.num_bytes if self.state is not None else 0
        self.kv_groups = layer_groups(layers)  # sliding and full layers' block tables apart
        self.kv = KVCache.allocate(
            config,
            layers,
            model,
            self.dtype,
            self.device,
            reserved=reserved,
            shared_bytes_per_token=self.draft.bytes_per_token() if self.draft is not None else 0,
            groups=self.kv_groups,
        )
        if self.draft is not None:  # a parallel pool, indexed by group 0's block ids
            self.draft.allocate(self.kv.num_blocks)
        self.inputs = InputPreparer(config.block_size, self.device, self.kv_groups.num_groups)
        self.graphs = self._graph_runner(config)
        self.sampler = Sampler(
            hf_config.vocab_size, list(config.eos_token_ids), self.device, config.seed
        )
        self.results = ResultBuilder(self.sampler)  # the sampling rank's StepResult
        self.requests = RequestTable()
        self.faults = Faults()
        self.vocab_size = hf_config.vocab_size
        self.mask_board: MaskBoard | None = None  # late grammar masks (in-process executor)

    def _attach_backend(self, layers: list) -> None:
        kinds = set().union(*(layer.backend_kinds() for layer in layers))
        if self.config.batch_invariant:  # DSA layers run their own ops (sparse.py), never a
            kinds.discard("dsa")  # backend: the C kernel need not list them to be the one
        request = BackendRequest(  # the shapes a backend with limits (flash_attn) checks
            dtype=self.dtype,
            head_sizes=tuple(sorted({layer.head_dim for layer in layers})),
            block_size=self.config.block_size,
            num_splits=1 if self.config.batch_invariant else 0,  # one reduction order
        )
        name = self.config.attention_backend
        if self.config.batch_invariant:
            name = batch_invariant_backend(name, self.device)
        backend = get_backend(name, self.device, kinds, request)
        for layer in layers:
            layer.backend = backend

    @property
    def samples(self) -> bool:
        return self.tp.rank == 0

    def info(self) -> RunnerInfo:
        return RunnerInfo(
            num_kv_blocks=self.kv.num_blocks,
            vocab_size=self.vocab_size,
            num_moe_layers=getattr(self.model, "num_moe_layers", 0),
            num_dsa_layers=getattr(self.model, "num_dsa_layers", 0),
            index_topk=getattr(self.model, "index_topk", 0),
            num_state_slots=self.state.num_slots if self.state is not None else 0,
            num_state_snapshots=self.state.num_snapshots if self.state is not None else 0,
            state_bytes_per_seq=self.state.bytes_per_seq if self.state is not None else 0,
            moe_top_k=getattr(self.model, "moe_top_k", 0),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            kv_bytes_per_token=self.tp.world_size * self._kv_bytes_per_token(),
            kv_group_windows=self.kv_groups.windows,
        )

    def _kv_bytes_per_token(self) -> int:
        draft = self.draft.bytes_per_token() if self.draft is not None else 0
        return bytes_per_token(self.model.attention_layers(), self.dtype, self.kv_groups) + draft

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
        start = time.perf_counter()
        entries = self.requests.apply(plan)
        scheduled = [item for item in entries if item is not None]
        if not scheduled:
            return StepResult.empty(len(entries)) if self.samples else None
        if self.config.mtp:
            attach_draft_probs(scheduled)
        self.faults.check("prepare")
        num_prefills = sum(1 for item in entries[: plan.num_prefills] if item is not None)
        if self.draft is not None:  # the draft model draws the placeholder drafts
            self.draft.propose(scheduled, self.inputs, self.sampler)
        step = self.inputs.prepare(scheduled, num_prefills)
        if self.state is not None:
            slots = [s for item, s in zip(entries, plan.state_slots) if item is not None]
            self.state.copy(plan.snapshot_copies)  # before the restores that may read them
            self.state.restore(plan.snapshot_restores)
            step.attn.linear = self.state.metadata(scheduled, num_prefills, slots)
        prepared = time.perf_counter()
        self.faults.check("forward")
        logits, routed, replayed, verify = self._run_forward(step, scheduled)
        if routed is not None:
            self.kv.store_routing(step.attn.slot_mapping, routed)
        if self.kv.indexer is not None:  # DSA: the step's selections, per KV slot
            chosen = self.model.indexer_topk()[: step.attn.num_tokens]
            self.kv.store_indexer(step.attn.slot_mapping, chosen)
        if self.state is not None:
            self.state.save_after(step.attn.linear, plan.snapshot_saves)
        computed = time.perf_counter()
        # NOTE: a skipped row computes its last position again, which a recurrent state
        # (linear attention) would absorb twice: such models wait for late masks instead
        masks = step_masks(self.mask_board, plan, scheduled, can_skip=self.state is None)
        result = (
            self.results.result(self.kv, scheduled, step, logits, masks) if self.samples else None
        )
        if not self.samples and self._draws(step):
            self.results.draw_only(scheduled, step, logits, masks)
        if self.config.mtp:  # every rank: the MTP layers' collectives, the same drafts
            assert self._hidden is not None  # an eager forward ran (no graph replay)
            # (chained steps run only the MTP block's full attention: no linear state)
            drafts = mtp_drafts(
                self.model, scheduled, step, self._hidden, self.sampler, self.config.num_mtp_drafts
            )
            if result is not None:
                result.mtp_drafts = drafts
        if self.state is not None:  # verify rows: the states of the accepted tokens only
            self.state.accept(step.attn.linear, scheduled, plan.snapshot_saves)
        self._advance(scheduled, step)
        skipped = roll_back_skipped(scheduled, masks)
        if result is None:
            return None
        result.skipped_seq_ids = tuple(skipped)
        if len(scheduled) < len(entries):  # entries of failed requests come back empty
            result = result.spread(
                [i for i, item in enumerate(entries) if item is not None], len(entries)
            )
        finished = time.perf_counter()
        result.graph_replayed, result.verify_graph_replayed = replayed, verify
        result.timings = {
            "started_at": start,
            "prepare": prepared - start,
            "forward": computed - prepared,
            "sample": finished - computed,
            "collectives": self.tp.clock.take(),
            "finished_at": finished,
        }
        return result

    def _draws(self, step: StepInputs) -> bool:
        """A rank that does not report draws the tokens too: under async scheduling (it fills
        placeholders), and in a step with verify rows on a linear-attention model (every rank
        must feed the same accepted drafts into its slice of the recurrent state)."""
        linear = step.attn.linear
        return (
            self.config.sample_on_every_rank
            or self.config.mtp  # every rank feeds the sampled tokens to the MTP layers
            or (linear is not None and linear.verify is not None)
        )

    def _run_forward(self, step: StepInputs, scheduled: list[ScheduledRequest]):
        """(logits, routed, replayed, replayed a verify graph): a decode batch or a verify
        batch that a graph holds replays it, anything else runs eagerly."""
        graphs = self.graphs
        if graphs is not None and not self.config.mtp:  # MTP needs the hidden states
            if graphs.fits(step):
                return *graphs.run(step), True, False
            sample_rows_only = all(item.num_sample_rows == item.num_new for item in scheduled)
            if graphs.fits_verify(step, sample_rows_only):
                return *graphs.run_verify(step), True, True
        return *self._forward(step), False, False

    def _forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager: (logits [rows, vocab] of the rows that need them, routed [T, ...] or None)."""
        hidden, routed = self.model(step.input_ids, step.positions, step.attn)
        self._hidden = hidden  # [T, H]: the MTP layer's input (mtp_drafts)
        return self.model.compute_logits(hidden.index_select(0, step.logits_indices)), routed

    def arm_fault(self, stage: str, times: int = 1) -> None:
        """Test hook: make the next `times` steps raise at `stage` ("prepare", "forward")."""
        self.faults.arm(stage, times)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (full, HF-named) checkpoint tensors; each parameter takes its rank's slice."""
        load_weights(self.model, weights)

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
