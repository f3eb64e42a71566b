"""AsyncLLMEngine: many concurrent requests over one LLMEngine, each an async iterator."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from actors.engine.config import EngineConfig
from actors.engine.llm_engine import LLMEngine, Prompt
from actors.engine.outputs import RequestOutput
from actors.engine.sampling_params import SamplingParams


class AsyncLLMEngine:
    """Runs the engine's steps in a worker thread and fans outputs out to per-request queues.

    `generate` yields cumulative `RequestOutput`s; leaving the iterator early (break, cancel, a
    client disconnect) aborts the request and frees its blocks. All engine calls happen on the
    step thread's side of `_lock`, so adds and aborts never race a step.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: Prompt, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        self._ensure_loop()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue  # before the add, so no output can miss it
        try:
            with self._lock:
                self.engine.add_request(request_id, prompt, params)  # ValueError on bad input
        except BaseException:
            del self._queues[request_id]
            raise
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its consumer (if any) gets a final output with reason "abort"."""
        with self._lock:
            outputs = self.engine.abort_request(request_id)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def stats_snapshot(self) -> dict:
        with self._lock:  # the step thread mutates the counters
            return self.engine.stats_snapshot()

    def check_health(self) -> None:
        """Raise if the step loop died (the replica should then be replaced)."""
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}") from self._error

    def _ensure_loop(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine loop died") from self._error
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                for out in await asyncio.to_thread(self._step):
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as e:  # surface to every waiter instead of hanging them
            self._error = e
            for queue in self._queues.values():
                queue.put_nowait(e)
            raise

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            return self.engine.step()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
