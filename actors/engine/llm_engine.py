"""LLMEngine, the offline engine: schedule, prepare, run, sample, postprocess, step by step."""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, cast

from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.engine_lora import EngineLoRA
from raylane.actors.engine.engine_weights import EngineWeights
from raylane.actors.engine.output_accumulator import run_to_completion
from raylane.actors.engine.output_shaper import OutputShapers
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.planner import StepPlanner
from raylane.actors.engine.postprocessor import Postprocessor
from raylane.actors.engine.request import Request
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.scheduler import Scheduler
from raylane.actors.engine.setup import EngineParts, build_engine_parts
from raylane.actors.engine.spec.speculation import speculation_for
from raylane.actors.engine.state_slots import StateSlotPool
from raylane.actors.engine.stats import EngineStats
from raylane.actors.engine.step_launcher import StepLauncher
from raylane.actors.engine.step_pipeline import StepPipeline
from raylane.actors.engine.upkeep import EngineUpkeep
from raylane.actors.engine.validate import RequestValidator, as_params_list, as_prompt_list
from raylane.actors.engine.weight_sync import WeightSync
from raylane.actors.lora import LoRARequest
from raylane.actors.lora.request import as_lora_list
from raylane.actors.runner.plan import StepResult

if TYPE_CHECKING:
    pass

Prompt = str | list[int]


class LLMEngine(EngineWeights, EngineLoRA):
    """A paged-KV, continuous-batching engine for one model, in this process or on a group of
    tensor-parallel Ray shards (`EngineConfig.tensor_parallel_size`).

    >>> engine = LLMEngine(EngineConfig(model="/path/to/hf_dir"))
    >>> outs = engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))
    >>> engine.shutdown()  # also runs at interpreter exit
    """

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        parts = parts or build_engine_parts(config)
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.executor = parts.executor
        self.runner_info = parts.runner_info
        self.planner = StepPlanner()
        self.block_manager = parts.block_manager
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            StateSlotPool(self.runner_info.num_state_slots)
            if self.runner_info.num_state_slots
            else None,
        )
        self.stop_checker = parts.stop_checker
        self.validator = RequestValidator(parts)
        self.grammars = parts.grammars
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.weights = WeightSync(self.executor, self.block_manager)
        self.upkeep = EngineUpkeep(self.executor, self.block_manager)  # sleep, weight checks
        # speculative decoding: one component the step asks (NoSpeculation when it is off)
        self.speculation = speculation_for(self.config, self.block_manager, self.stats)
        self.post, self.launcher, self.pipeline = self._step_parts()
        self.shapers = OutputShapers()  # the public loop's outputs (step, abort_request)
        self._ids = itertools.count()
        # NOTE: a weak method, so an engine that is dropped is not kept alive until exit
        self._atexit = weakref.WeakMethod(self.shutdown)
        atexit.register(_call_if_alive, self._atexit)

    def _step_parts(self) -> tuple[Postprocessor, StepLauncher, StepPipeline]:
        """The step's postprocessor, launcher and pipeline, around the one speculation."""
        post = Postprocessor(
            self.scheduler,
            self.planner,
            self.stop_checker,
            self.stats,
            self.requests,
            lambda: self.weights.version,
            self.speculation,
        )
        launcher = StepLauncher(
            self.scheduler,
            self.planner,
            self.executor,
            self.grammars,
            post,
            self.stats,
            self.speculation,
        )
        pipeline = StepPipeline(
            self.config, self.scheduler, launcher, post, self.stats, self.speculation
        )
        return post, launcher, pipeline

    def shutdown(self) -> None:
        """Free the runners: every shard actor and the placement group (idempotent)."""
        self.executor.shutdown()
        if self.launcher.masks is not None:
            self.launcher.masks.shutdown()

    def retract_all(self) -> int:
        """Free the KV of every running sequence; when scheduled again each re-prefills its
        prompt and generated tokens (under the weights of that time). Returns how many."""
        self.pipeline.quiesce()
        retracted = self.scheduler.retract_all()
        self.planner.preempted(retracted)
        return len(retracted)

    def flush_cache(self) -> None:
        """Forget every cached prefix block (blocks in use are untouched)."""
        self.block_manager.reset_prefix_cache()

    def check_health(self, ping: bool = True) -> None:
        """Raise when the runners can no longer serve (e.g. a shard died); `ping=False` only
        reports failures already seen, with no call to the shards."""
        self.executor.check_health(ping)

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """vLLM's: queue a request; `step()` reports it in `params.output_kind`."""
        params = params or SamplingParams()
        self.admit(request_id, prompt, params, lora_request)
        self.shapers.start(request_id, params.output_kind)

    def admit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request whose outputs are the engine core's deltas (`step_deltas`,
        `end_step`): the serving path's and `generate`'s, which fold or stream them.
        `lora_request`: the adapter it runs on (its newest version now, to its end)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        token_ids = self.validator.check(prompt, params)
        lora = self._bind_lora(lora_request)
        text = prompt if isinstance(prompt, str) else None
        request = Request(
            request_id, text, token_ids, params, self.config.block_size, self.tokenizer
        )
        if params.structured_outputs is not None:
            matchers = self.grammars.matchers(params.structured_outputs, len(request.seqs))
            for seq, matcher in zip(request.seqs, matchers):
                seq.matcher = matcher
        for seq in request.seqs:
            seq.lora = lora
        self.requests[request_id] = request
        self._queue(request, lora_request)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests and free their blocks; returns the final ("abort") outputs of those
        added with `add_request`, in their output kind (unknown ids are skipped). A step in
        flight that holds them computes on, and what it computes for them is dropped."""
        return self.shapers.shape(self.abort_deltas(request_id))

    def abort_deltas(self, request_id: str | Iterable[str]) -> list[EngineCoreOutput]:
        """`abort_request`, as the engine core's final deltas (of any request)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        return self.post.abort(ids)

    def has_unfinished_requests(self) -> bool:
        """Requests run, or outputs wait for the next step (those of a step drained by a
        weight update, or its stale ends): vLLM's loop steps until both are done."""
        return bool(self.requests) or self.pipeline.holds_outputs

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step (StepPipeline) -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """vLLM's: run one scheduling step; returns an output for each request added with
        `add_request` that it advanced, in the request's `output_kind` (cumulative by
        default). With async scheduling one step is in flight between calls (StepPipeline)."""
        return self.shapers.shape(self.step_deltas())

    def step_deltas(self) -> list[EngineCoreOutput]:
        """`step`, as the engine core's deltas: what every request it advanced gained."""
        self.begin_step()
        return self.end_step()

    def begin_step(self, plan_ahead: bool = True) -> Future[StepResult] | None:
        """The first half of `step`: launch what is due; returns the future `end_step` will
        wait for (None: nothing to wait for). An event loop awaits it, then calls end_step.
        `plan_ahead=False` leaves launching the step after it to a later `plan_ahead()`."""
        self._admit_waiting_loras()
        return self.pipeline.begin_step(plan_ahead)

    def plan_ahead(self) -> bool:
        """With async scheduling, launch the step after the one due while that one runs (once;
        True if it launched one; see StepPipeline.plan_ahead for when it does not)."""
        return self.pipeline.plan_ahead()

    def end_step(self) -> list[EngineCoreOutput]:
        """The second half of `step`: fold in the step begin_step launched (if drain has not)."""
        return self.pipeline.end_step()

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for every step in flight and fold them in, planning nothing new (before a
        pause, a weight update or a retract); returns their outputs."""
        return self.pipeline.drain()

    # --- statistics ---------------------------------------------------------------------------

    def stats_snapshot(self, paused: bool = False) -> dict:
        snap = self.stats.snapshot(self.scheduler, self.block_manager, self.weight_version, paused)
        snap["gauges"]["kv_cache_bytes_per_token"] = self.runner_info.kv_bytes_per_token
        snap["gauges"]["batch_invariant"] = int(self.config.batch_invariant)
        return snap

    # --- batch helpers ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of `prompts`.
        `lora_request`: one adapter for all, or a list, one per prompt (None: base model)."""
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(params, len(prompts))
        loras = as_lora_list(lora_request, len(prompts))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params_list, loras):
                self.admit(rid, prompt, p, lora)
        except ValueError:  # one bad request: none of the batch stays queued
            self.abort_deltas([rid for rid in ids if rid in self.requests])
            raise
        return run_to_completion(ids, self.step_deltas, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then `generate`."""
        one = bool(messages) and isinstance(messages[0], dict)  # one conversation, or a list
        convs = cast(list[list[dict]], [messages] if one else messages)
        prompts: list[Prompt] = [self.validator.render_chat(c, **template_kwargs) for c in convs]
        return self.generate(prompts, params, use_tqdm, lora_request)


def _call_if_alive(method_ref: weakref.WeakMethod) -> None:
    method = method_ref()
    if method is not None:
        method()
