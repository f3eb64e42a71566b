"""AsyncLLMEngine: many concurrent requests over one LLMEngine, each an async iterator."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from raylane.actors.engine.async_control import AsyncEngineControl
from raylane.actors.engine.async_lora import AsyncEngineLoRA
from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.llm_engine import LLMEngine, Prompt
from raylane.actors.engine.output_shaper import OutputShaper
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.plan_ahead import PlanAheadClock
from raylane.actors.engine.request_stream import OutputQueue, RequestStream
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.lora import LoRARequest

# The model runs in a worker thread that takes the GIL back after every torch op, while this
# loop's thread runs the consumers' Python: at CPython's default 5 ms switch interval the runner
# waits for the loop's thread that long at a time. Measured in one process (SmolLM2, 32 streams,
# 2 cores): AsyncLLMEngine kept 75-77% of LLMEngine.generate's tok/s at 5 ms, 83-85% at 0.5 ms;
# LLMEngine.generate alone did not change.
GIL_SWITCH_INTERVAL_S = 5e-4


class AsyncLLMEngine(AsyncEngineControl, AsyncEngineLoRA):
    """Steps the engine in a task on the event loop and fans outputs out to per-request queues.

    `generate` yields `RequestOutput`s in the request's `output_kind`, as vLLM's does
    (cumulative by default; built from the engine's deltas by an `OutputShaper`);
    `add_request` gives the deltas themselves (`EngineCoreOutput`), for callers that stream
    them on. Leaving either early (break, cancel, a client disconnect)
    aborts the request and frees its blocks. The engine's bookkeeping runs
    on the loop's thread; the model runs on the executor's side (a worker thread, or shard
    actors), and the loop awaits each step, so it serves other tasks while the model computes.
    An output whose request failed (a step raised) raises `RequestFailed` in its consumer.
    Pause, resume, weight updates and sleep are its base's, `AsyncEngineControl`; the LoRA
    verbs `AsyncEngineLoRA`'s.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_paused_requests: int = 1024,
        gil_switch_interval_s: float | None = GIL_SWITCH_INTERVAL_S,
    ):
        """`gil_switch_interval_s`: lowers the process's `sys.setswitchinterval` to this
        (None: leave it), see `GIL_SWITCH_INTERVAL_S`."""
        if gil_switch_interval_s is not None:
            sys.setswitchinterval(min(sys.getswitchinterval(), gil_switch_interval_s))
        self.engine = engine
        self.max_paused_requests = max_paused_requests
        self._paused: str | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._num_held = 0  # requests waiting for a resume
        self._queues: dict[str, OutputQueue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._clock = PlanAheadClock()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        shaper = OutputShaper((params or SamplingParams()).output_kind)
        deltas_of = self.generate_deltas(prompt, params, request_id, lora_request)
        async with aclosing(deltas_of) as deltas:
            async for delta in deltas:
                out = shaper.shape(delta)
                if out is not None:
                    yield out

    async def generate_deltas(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """`generate`, as the engine's deltas: what each step added (the prompt on the first)."""
        stream = await self.add_request(prompt, params, request_id, lora_request)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Admit a request now and return its outputs (deltas). What is wrong with it (a
        ValueError), a duplicate id and a paused engine's full queue (`EnginePaused`) raise
        here; while paused it waits for the resume."""
        self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        if self._paused is not None:
            self.engine.validator.check(prompt, params or SamplingParams())  # fail now, not later
            await self._admitted()
        self.engine.admit(request_id, prompt, params, lora_request)
        queue = OutputQueue()
        self._queues[request_id] = queue
        self._start()
        return RequestStream(self._release, request_id, queue)

    async def abort(self, request_ids: str | list[str] | None) -> list[RequestOutput]:
        """Stop requests (None: every request the engine runs); their consumers get a final
        output with reason "abort". Returns their cumulative partial outputs (unknown ids
        are skipped). Their blocks are freed."""
        if request_ids is None:
            request_ids = list(self.engine.requests)
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        requests = [r for rid in ids if (r := self.engine.requests.get(rid)) is not None]
        self._fan_out(self.engine.abort_deltas(ids))
        return [r.output(self.engine.weight_version) for r in requests]

    def stats_snapshot(self) -> dict:
        # steps run on this thread: no lock needed
        return self.engine.stats_snapshot(paused=self.paused_mode is not None)

    @property
    def num_requests(self) -> int:
        """Requests this engine holds: streaming, or waiting for a resume."""
        return len(self._queues) + self._num_held

    def check_health(self) -> None:
        """Raise if the step loop died (the replica should then be replaced)."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}") from self._error

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._wakeup))
        assert self._wakeup is not None  # set above with the first task
        self._wakeup.set()

    async def _run(self, wakeup: asyncio.Event) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests() or self._frozen():
                    self._clock.idle()
                    wakeup.clear()
                    await wakeup.wait()
                    continue
                due = self.engine.begin_step(plan_ahead=False)
                if due is not None:
                    # the step runs on the executor's side: consumers, new requests, aborts
                    # and client disconnects are served meanwhile
                    await self._plan_ahead(asyncio.wrap_future(due))
                else:
                    await asyncio.sleep(0.001)  # nothing ran (e.g. only failed plans)
                self._fan_out(self.engine.end_step())
        except Exception as e:  # surface to every waiter instead of hanging them
            self._error = e
            for queue in list(self._queues.values()):  # a forwarded stream releases itself
                queue.put_nowait(e)

    async def _plan_ahead(self, due: asyncio.Future) -> None:
        """Plan the next step while `due` runs, as late as `PlanAheadClock` deems safe, then
        wait for `due`."""
        loop = asyncio.get_running_loop()
        wait = self._clock.wait_s(loop.time())
        if wait:
            await asyncio.wait([due], timeout=wait)
        started = time.perf_counter()
        if self.engine.plan_ahead():
            self._clock.planned(time.perf_counter() - started)
        await asyncio.wait([due])
        self._clock.step_done(loop.time())

    def _frozen(self) -> bool:
        """Paused in a mode that stops the steps ("wait" lets in-flight requests run)."""
        return self._paused is not None and self._paused != "wait"

    def _fan_out(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _release(self, request_id: str, queue: asyncio.Queue, finished: bool) -> None:
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]
        if not finished:
            self.engine.abort_deltas(request_id)
