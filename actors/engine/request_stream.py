"""RequestStream: one admitted request's outputs from `AsyncLLMEngine`, as an async iterator, or
pushed to a callback as the engine fans them out (`forward`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from raylane.actors.engine.errors import RequestFailed
from raylane.actors.engine.outputs import EngineCoreOutput


class OutputQueue(asyncio.Queue):
    """A request's outputs as the engine puts them: queued for an iterating consumer, or, once
    `listener` is set, handed to it at once (no task wakes per output)."""

    listener: Callable[[Any], None] | None = None

    def put_nowait(self, item: Any) -> None:
        if self.listener is not None:
            self.listener(item)
        else:
            super().put_nowait(item)


class RequestStream:
    """One admitted request's outputs (`AsyncLLMEngine.add_request`): the engine's deltas,
    ending with its final one. `close()` releases it (it is called when the stream ends or raises);
    closing before the final output aborts the request and frees its blocks."""

    def __init__(
        self,
        release: Callable[[str, asyncio.Queue, bool], None],
        request_id: str,
        queue: OutputQueue,
    ) -> None:
        """`release(request_id, queue, finished)`: the owner forgets the stream (and aborts the
        request if it did not finish)."""
        self.request_id = request_id
        self.finished = False
        self._release = release
        self._queue = queue
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self._closed:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def forward(self, deliver: Callable[[str, EngineCoreOutput | Exception], None]) -> None:
        """Instead of iterating: `deliver(request_id, item)` each output as the engine fans it
        out, on its thread and without a task per request (an output channel forwards a step's
        outputs of every request this way). An item is what iterating would give: the delta,
        or the exception it would raise; the stream ends (and is released) after the final one
        or an exception."""

        def push(item: Any) -> None:
            try:
                out: EngineCoreOutput | Exception = self._take(item)
            except Exception as e:  # RequestFailed, or the step loop died
                out = e
            deliver(self.request_id, out)

        while not self._queue.empty():  # put before the listener was set
            push(self._queue.get_nowait())
        self._queue.listener = push

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self.request_id, self._queue, self.finished)

    def _take(self, item: Any) -> EngineCoreOutput:
        """One output from the engine as the consumer gets it; releases the stream at its end."""
        if isinstance(item, BaseException):  # the step loop died
            self.close()
            raise item
        self.finished = item.finished
        if item.error is not None:
            self.close()
            raise RequestFailed(f"request {self.request_id}: {item.error}")
        if self.finished:
            self.close()
        return item
