"""A request's merged stream as an HTTP answer: primed (the first output awaited, so a rejected
request keeps its status), as SSE events, or folded into cumulative outputs; a client that
disconnects cancels the work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.router.errors import ReplicaFailed
from raylane.session_server.errors import ClientGone, error_body, from_exception
from raylane.session_server.streaming.fan_in import Indexed

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it close its backend iterators
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        # the body is already read, so a server following ASGI blocks until the client leaves;
        # one that answers at once must not make this spin
        await asyncio.sleep(0.1)


async def final_outputs(
    request: Request, stream: AsyncGenerator[Indexed, None], num_prompts: int
) -> dict[int, RequestOutput]:
    """Run every prompt to completion; the cumulative output of each, by prompt index."""

    async def collect() -> dict[int, RequestOutput]:
        accumulators: dict[int, OutputAccumulator] = {}
        finished: set[int] = set()
        async with aclosing(stream):
            async for i, out in stream:
                accumulators.setdefault(i, OutputAccumulator()).add(out)
                if out.finished:
                    finished.add(i)
        if len(finished) != num_prompts:
            raise ReplicaFailed("the engine stream ended before the request finished")
        return {i: acc.output() for i, acc in accumulators.items()}

    return await until_disconnect(request, collect())


async def primed(
    request: Request, stream: AsyncGenerator[Indexed, None]
) -> AsyncGenerator[Indexed, None]:
    """Wait for the first output before answering, so a rejected request (bad input, busy or
    failed replica) still gets its own status code instead of a 200 stream with an error."""
    try:
        first = await until_disconnect(request, anext(stream, None))
    except BaseException:
        await stream.aclose()
        raise

    async def chained() -> AsyncGenerator[Indexed, None]:
        async with aclosing(stream):
            if first is not None:
                yield first
            async for item in stream:
                yield item

    return chained()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def sse_response(
    stream: AsyncGenerator[Indexed, None],
    chunks: Callable[[int, EngineCoreOutput], list[dict]],
    tail: Callable[[], list[dict]],
) -> StreamingResponse:
    """`chunks(i, out)` turns each output into events, `tail()` adds the last ones (usage);
    an error mid-stream becomes an error event; the stream always ends with `[DONE]`."""

    async def body() -> AsyncGenerator[str, None]:
        async with aclosing(stream):
            try:
                async for i, out in stream:
                    for chunk in chunks(i, out):
                        yield sse(chunk)
                for chunk in tail():
                    yield sse(chunk)
            except Exception as e:  # noqa: BLE001 - a disconnect (CancelledError) passes
                err = from_exception(e)
                yield sse(error_body(err.status, err.message, err.param, err.code, err.type))
        yield DONE

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
