"""RequestStream: one admitted request's outputs from `AsyncLLMEngine`, as an async iterator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from raylane.actors.engine.errors import RequestFailed
from raylane.actors.engine.outputs import EngineCoreOutput


class RequestStream:
    """One admitted request's outputs (`AsyncLLMEngine.add_request`): the engine's deltas,
    ending with its final one. `close()` releases it (it is called when the stream ends or raises);
    closing before the final output aborts the request and frees its blocks."""

    def __init__(
        self,
        release: Callable[[str, asyncio.Queue, bool], None],
        request_id: str,
        queue: asyncio.Queue,
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
        item = await self._queue.get()
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

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release(self.request_id, self._queue, self.finished)
