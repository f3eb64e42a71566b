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
from raylane.actors.models.layer_layout import shared_window
from raylane.actors.runner import weight_checks
from raylane.actors.runner.config import RunnerConfig, RunnerInfo
from raylane.actors.runner.faults import Faults
from raylane.actors.runner.graph_runner import GraphRunner
from raylane.actors.runner.inputs import InputPreparer, StepInputs
from raylane.actors.runner.kv_cache import KVCache, bytes_per_token
from raylane.actors.runner.mask_board import SKIP, MaskBoard, roll_back_skipped, step_masks
from raylane.actors.runner.mtp_drafts import attach_draft_probs, mtp_drafts
from raylane.actors.runner.plan import ExtraTokens, StepPlan, StepResult
from raylane.actors.runner.requests import RequestTable, ScheduledRequest
from raylane.actors.runner.sampler import Sampler
from raylane.actors.runner.spec_verify import accept, sampling_rows
from raylane.actors.runner.state_cache import StateCache
from raylane.actors.runner.weight_spill import WeightSpill
from raylane.actors.runner.weight_updates import RunnerWeights
from raylane.kernels.attention import get_backend


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = resolve_device(config.device)
        model, hf_config, _ = load_model(
            config.model_dir,
            resolve_dtype(config.dtype, self.device),
            self.device,
            self.tp,
            pack_weights=config.pack_weights,
        )
        # the architecture's class (attention_layers, compute_logits), not a plain nn.Module
        self.model: Any = cast(Any, model)
        self.hf_config = hf_config
        if config.mtp and not len(getattr(self.model, "mtp_layers", ())):
            raise ValueError(
                "EngineConfig.speculative_config.method='mtp': the model has no MTP layers "
                "(num_nextn_predict_layers, with their weights in the checkpoint)"
            )
        self._hidden: torch.Tensor | None = None
        self.dtype = next(model.parameters()).dtype
        self.weights = RunnerWeights(self.model, hf_config, self.tp, self.device)
        self.spill = WeightSpill()  # a level-2 sleep's weights
        layers = self.model.attention_layers()
        kinds = set().union(*(layer.backend_kinds() for layer in layers))
        backend = get_backend(config.attention_backend, self.device, kinds)
        for layer in layers:
            layer.backend = backend
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
        self.kv = KVCache.allocate(
            config, layers, model, self.dtype, self.device, reserved=reserved
        )
        self.inputs = InputPreparer(config.block_size, self.device)
        self.graphs = self._graph_runner(config)
        self.sampler = Sampler(
            hf_config.vocab_size, list(config.eos_token_ids), self.device, config.seed
        )
        self.requests = RequestTable()
        self.faults = Faults()
        self.vocab_size = hf_config.vocab_size
        self.mask_board: MaskBoard | None = None  # late grammar masks (in-process executor)

    def _graph_runner(self, config: RunnerConfig) -> GraphRunner | None:
        eager = config.enforce_eager
        if eager is None:
            eager = self.device.type != "cuda"
        if eager:
            return None
        graphs = GraphRunner(
            self.model,
            self.kv,
            config.cudagraph_capture_sizes,
            config.max_model_len,
            self.device,
            self.state,
        )
        if self.device.type == "cuda":
            graphs.capture()
        return graphs

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
            kv_bytes_per_token=self.tp.world_size
            * bytes_per_token(self.model.attention_layers(), self.dtype),
            sliding_window=shared_window(self.model.attention_layers()),
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
        start = time.perf_counter()
        entries = self.requests.apply(plan)
        scheduled = [item for item in entries if item is not None]
        if not scheduled:
            return StepResult.empty(len(entries)) if self.samples else None
        if self.config.mtp:
            attach_draft_probs(scheduled)
        self.faults.check("prepare")
        num_prefills = sum(1 for item in entries[: plan.num_prefills] if item is not None)
        step = self.inputs.prepare(scheduled, num_prefills)
        if self.state is not None:
            slots = [s for item, s in zip(entries, plan.state_slots) if item is not None]
            self.state.copy(plan.snapshot_copies)  # before the restores that may read them
            self.state.restore(plan.snapshot_restores)
            step.attn.linear = self.state.metadata(scheduled, num_prefills, slots)
        prepared = time.perf_counter()
        self.faults.check("forward")
        graphs = self.graphs
        # MTP needs the hidden states, which a replayed graph does not return
        replayed = graphs is not None and not self.config.mtp and graphs.fits(step)
        logits, routed = (
            graphs.run(step) if graphs is not None and replayed else self._forward(step)
        )
        if routed is not None:
            self.kv.store_routing(step.attn.slot_mapping, routed)
        if self.kv.indexer is not None:  # DSA: the step's selections, per KV slot
            chosen = self.model.indexer_topk()[: step.attn.num_tokens]
            self.kv.store_indexer(step.attn.slot_mapping, chosen)
        if self.state is not None:
            self.state.save(plan.snapshot_saves)
        computed = time.perf_counter()
        # NOTE: a skipped row computes its last position again, which a recurrent state
        # (linear attention) would absorb twice: such models wait for late masks instead
        masks = step_masks(self.mask_board, plan, scheduled, can_skip=self.state is None)
        result = self._result(scheduled, step, logits, masks) if self.samples else None
        if self.config.mtp and result is not None:
            assert self._hidden is not None  # an eager forward ran (no graph replay)
            result.mtp_drafts = mtp_drafts(self.model, scheduled, step, self._hidden, self.sampler)
        if not self.samples and self.config.sample_on_every_rank:
            self._draw_only(scheduled, step, logits, masks)
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
        result.graph_replayed = replayed
        result.timings = {
            "started_at": start,
            "prepare": prepared - start,
            "forward": computed - prepared,
            "sample": finished - computed,
            "collectives": self.tp.clock.take(),
            "finished_at": finished,
        }
        return result

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

    # weight updates (RL): `self.weights` (RunnerWeights), reached as "weights.<method>"

    # --- weight checks and sleep (the trainer protocols; runner/weight_checks.py) -------------

    def weight_checksums(self) -> dict[str, str]:
        return weight_checks.weight_checksums(self.model)

    def reset_weights(self, seed: int) -> None:
        self.weights.settle()  # the last commit's re-pack first
        weight_checks.reset_weights(self.model, seed)

    def release_kv_cache(self) -> None:
        """Free the KV cache (and the routing record); `restore_kv_cache` brings it back."""
        weight_checks.release_kv_cache(self.model.attention_layers(), self.dtype, self.device)
        self.kv.routing, self.graphs = None, None  # the graphs captured the old tensors

    def release_weights(self) -> None:
        """Level-2 sleep: the weights spilled to a file and their memory freed."""
        self.weights.settle()  # the last commit's re-pack first
        self.spill.release(self.model)
        self.graphs = None  # the graphs captured the old tensors

    def restore_weights(self) -> None:
        """The spilled weights back (before the KV cache, whose restore captures graphs)."""
        self.spill.restore(self.model)

    def restore_kv_cache(self) -> None:
        """A zeroed KV cache of the same number of blocks (the engine's block table is kept)."""
        layers = self.model.attention_layers()
        self.kv = KVCache.allocate(
            self.config, layers, self.model, self.dtype, self.device, self.kv.num_blocks
        )
        self.graphs = self._graph_runner(self.config)

    # --- results (sampling rank) --------------------------------------------------------------

    def _result(
        self,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        logits: torch.Tensor,
        masks: dict[int, object],
    ) -> StepResult:
        result = StepResult.empty(len(scheduled))
        picks, sampled, firsts = self._draw(scheduled, step, logits, masks)
        for k, i in zip(firsts, picks):
            result.token_ids[i] = sampled.token_ids[k]
            result.logprobs[i] = sampled.logprobs[k]
            result.top_logprobs[i] = sampled.top_logprobs[k]
            result.kept_mass[i] = sampled.kept_mass[k]
            last = k + scheduled[i].num_accepted
            if last > k:  # a verify row's accepted drafts: the target's tokens after them
                more = slice(k + 1, last + 1)
                result.extra[i] = ExtraTokens(
                    sampled.token_ids[more],
                    sampled.logprobs[more],
                    sampled.top_logprobs[more],
                    sampled.kept_mass[more],
                )
            scheduled[i].state.last_sampled = sampled.token_ids[last]
        for i, item in enumerate(scheduled):
            entries, ranks = self._prompt_logprobs(item, step.logits_rows[i], logits)
            result.prompt_logprobs[i], result.prompt_ranks[i] = entries, ranks
        self._routed_experts(scheduled, result)
        return result

    def _draw_only(
        self,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        logits: torch.Tensor,
        masks: dict[int, object],
    ) -> None:
        """A rank that does not report: draw the same tokens as rank 0, to fill placeholders."""
        picks, drawn, firsts = self._draw(scheduled, step, logits, masks, tokens_only=True)
        for k, i in zip(firsts, picks):
            scheduled[i].state.last_sampled = drawn.token_ids[k + scheduled[i].num_accepted]

    def _draw(
        self,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        logits: torch.Tensor,
        masks: dict[int, object],
        tokens_only: bool = False,
    ):
        """Sample the rows whose chunk reaches the end of its sequence: (their indices in
        `scheduled`, the SampleResult, each one's first position in it), or ([], None, [])
        when none does. A verify row samples 1 + k positions (see spec_verify)."""
        picks = [
            i
            for i, item in enumerate(scheduled)
            if item.samples and masks.get(item.state.seq_id) is not SKIP
        ]
        if not picks:
            return picks, None, []
        rows, states, proposals = sampling_rows(scheduled, picks, step.logits_rows)
        sampled = self.sampler(
            logits[rows],
            states,
            tokens_only=tokens_only,
            masks=[masks.get(s.seq_id) for s in states],
            proposals=proposals,
        )
        return picks, sampled, accept(scheduled, picks, sampled.token_ids)

    def _prompt_logprobs(
        self, item: ScheduledRequest, rows: tuple[int, int], logits: torch.Tensor
    ) -> tuple[list[dict[int, float]], list[int]]:
        """Each new prompt position's top-N and own logprob, and the prompt token's rank."""
        state = item.state
        first, count = rows
        count -= item.num_sample_rows  # sampling rows are not prompt rows
        if state.params.prompt_logprobs is None or count <= 0:
            return [], []
        lp = logits[first : first + count].float().log_softmax(dim=-1)  # [count, V]
        target0 = state.num_prompt_logprobs_done
        targets = torch.tensor(state.token_ids[target0 : target0 + count], device=lp.device)
        chosen_t = lp.gather(1, targets.unsqueeze(1))  # [count, 1]
        ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()  # vLLM's: 1 + how many beat it
        chosen = chosen_t.squeeze(1).tolist()
        top_v, top_i = lp.topk(state.params.prompt_logprobs, dim=-1)  # k=0 gives empty rows
        entries = []
        for t, c, tv, ti in zip(targets.tolist(), chosen, top_v.tolist(), top_i.tolist()):
            entry = dict(zip(ti, tv))
            entry[t] = c
            entries.append(entry)
        return entries, ranks

    def _routed_experts(self, scheduled: list[ScheduledRequest], result: StepResult) -> None:
        """The per-slot replay records (routed experts; a DSA model's indexer top-k) of the
        positions newly in each asking sequence's record."""
        if self.kv.routing is not None:
            self._report(scheduled, result.routed_experts, "routed", self.kv.read_routing)
        if self.kv.indexer is not None:
            self._report(scheduled, result.indexer_topk, "indexer", self.kv.read_indexer)

    def _report(self, scheduled: list[ScheduledRequest], column: list, kind: str, read) -> None:
        """Positions newly in each asking sequence's `kind` record (a cache hit's prefix, then
        this chunk), read from the device record in one copy after the step."""
        asked = "return_routed_experts" if kind == "routed" else "return_indexer_topk"
        counter = f"num_{kind}_reported"
        rows, spans = [], []
        for i, item in enumerate(scheduled):
            state = item.state
            # a verify row's rejected drafts are no positions of the sequence
            start = getattr(state, counter)
            end = item.context_len - len(item.drafts) + item.num_accepted
            # end <= start: a recompute after preemption, already reported
            if getattr(state.params, asked) and end > start:
                setattr(state, counter, end)
                rows.append(i)
                spans.append((state.block_ids, start, end))
        if spans:
            for i, record in zip(rows, read(spans)):
                column[i] = record

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
