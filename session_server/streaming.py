"""Driving backend streams for one HTTP request: fan-in, deltas, SSE, and disconnects.

Every backend iterator is closed (`aclosing`) when the response ends for any reason — a finished
stream, an error, or a client that went away (Starlette cancels the body iterator; a task waiting
on the backend is cancelled) — so the engine aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput, aborted
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import ReplicaFailed
from raylane.session_server.backend import EngineBackend
from raylane.session_server.errors import ClientGone, error_body, from_exception

T = TypeVar("T")
Indexed = tuple[int, RequestOutput]  # (prompt index, cumulative output)
DONE = "data: [DONE]\n\n"


def start(
    backend: EngineBackend,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    routing_key: str | None,
    timeout_s: float | None = None,
) -> AsyncIterator[Indexed]:
    """One backend request per prompt (ids `<request_id>-<i>` when several), merged. Past
    `timeout_s` the requests still running end with their partial outputs, finish reason
    "abort" (and are aborted on the engine)."""
    merged = _start(backend, prompts, params, request_id, routing_key)
    if timeout_s is None:
        return merged
    return _with_deadline(merged, prompts, params, request_id, timeout_s)


def _start(
    backend: EngineBackend,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    routing_key: str | None,
) -> AsyncIterator[Indexed]:
    if len(prompts) == 1:
        return _single(backend.generate(prompts[0], params, request_id, routing_key))
    iterators = []
    try:
        for i, prompt in enumerate(prompts):
            iterators.append(backend.generate(prompt, params, f"{request_id}-{i}", routing_key))
    except BaseException:
        for it in iterators:
            _close_soon(it)
        raise
    return _merge(iterators)


async def _with_deadline(
    stream: AsyncIterator[Indexed],
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    timeout_s: float,
) -> AsyncIterator[Indexed]:
    last: dict[int, RequestOutput] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aclosing(stream):  # closing it aborts what still runs on the engine
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    i, out = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                break
            last[i] = out
            yield i, out
    for i, prompt in enumerate(prompts):
        if i not in last or not last[i].finished:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            yield i, _ended_at_deadline(last.get(i), prompt, params, rid)


def _ended_at_deadline(
    out: RequestOutput | None, prompt: list[int], params: SamplingParams, request_id: str
) -> RequestOutput:
    """The partial output as final, every unfinished sample's finish reason "abort"."""
    if out is None:  # nothing came back yet: empty samples
        asked = [] if params.logprobs is not None else None
        empty = [
            CompletionOutput(k, "", [], logprobs=asked, top_logprobs=asked) for k in range(params.n)
        ]
        out = RequestOutput(request_id, None, list(prompt), empty, False)
    return aborted(out)


async def _single(iterator: AsyncIterator[RequestOutput]) -> AsyncIterator[Indexed]:
    async with aclosing(iterator):
        async for out in iterator:
            yield 0, out


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Indexed]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, iterator: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(iterator):
                async for out in iterator:
                    queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # each closes its backend iterator as it unwinds
            task.cancel()


def _close_soon(iterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        asyncio.ensure_future(aclose())


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
    request: Request, stream: AsyncIterator[Indexed], num_prompts: int
) -> dict[int, RequestOutput]:
    """Run every prompt to completion; the last output of each, by prompt index."""

    async def collect() -> dict[int, RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async with aclosing(stream):
            async for i, out in stream:
                last[i] = out
        if len(last) != num_prompts or not all(out.finished for out in last.values()):
            raise ReplicaFailed("the engine stream ended before the request finished")
        return last

    return await until_disconnect(request, collect())


async def primed(request: Request, stream: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    """Wait for the first output before answering, so a rejected request (bad input, busy or
    failed replica) still gets its own status code instead of a 200 stream with an error."""
    try:
        first = await until_disconnect(request, anext(stream, None))
    except BaseException:
        await stream.aclose()
        raise

    async def chained() -> AsyncIterator[Indexed]:
        async with aclosing(stream):
            if first is not None:
                yield first
            async for item in stream:
                yield item

    return chained()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def sse_response(
    stream: AsyncIterator[Indexed],
    chunks: Callable[[int, RequestOutput], list[dict]],
    tail: Callable[[], list[dict]],
) -> StreamingResponse:
    """`chunks(i, out)` turns each output into events, `tail()` adds the last ones (usage);
    an error mid-stream becomes an error event; the stream always ends with `[DONE]`."""

    async def body() -> AsyncIterator[str]:
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


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    text_offset: int  # where `text` starts in the choice's whole text
    finished: bool
    first: bool  # the choice's first delta


@dataclass
class ChoiceCursor:
    """What one choice has sent so far. While it runs, the last `hold` characters stay back:
    they might be the start of a stop string that the engine will trim away."""

    hold: int = 0
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        if self.done:
            return None
        end = len(c.text) if c.finished else max(self.sent_chars, len(c.text) - self.hold)
        start, n0 = self.sent_chars, self.sent_tokens
        if end <= start and len(c.token_ids) <= n0 and not c.finished:
            return None
        self.sent_chars, self.sent_tokens, self.done = max(end, start), len(c.token_ids), c.finished
        return Delta(
            c.text[start:end],
            c.token_ids[n0:],
            c.logprobs[n0:] if c.logprobs is not None else None,
            c.top_logprobs[n0:] if c.top_logprobs is not None else None,
            start,
            c.finished,
            first=start == 0 and n0 == 0,
        )


def hold_for(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_list), default=1) - 1
