"""Driving backend streams for one HTTP request: fan-in, deltas, SSE, and disconnects.

A backend stream is the engine's own deltas (`EngineCoreOutput`): a streamed response turns each
into SSE chunks as it comes (`ChoiceCursor`, `PromptSeen`: O(new tokens) per step, no
cumulative rebuild); only a non-streaming response folds them into cumulative outputs
(`final_outputs`).

Every backend iterator is closed (`aclosing`) when the response ends for any reason — a finished
stream, an error, or a client that went away (Starlette cancels the body iterator; a task waiting
on the backend is cancelled) — so the engine aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput, SampleDelta
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.errors import ReplicaFailed
from raylane.session_server.backend import EngineBackend
from raylane.session_server.errors import ClientGone, error_body, from_exception

T = TypeVar("T")
Indexed = tuple[int, EngineCoreOutput]  # (prompt index, what the step added)
DONE = "data: [DONE]\n\n"


def start(
    backend: EngineBackend,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    routing_key: str | None,
    timeout_s: float | None = None,
) -> AsyncGenerator[Indexed, None]:
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
) -> AsyncGenerator[Indexed, None]:
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
    stream: AsyncGenerator[Indexed, None],
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    timeout_s: float,
) -> AsyncGenerator[Indexed, None]:
    ended: dict[int, set[int]] = {}  # prompt index -> its samples that finished
    held: dict[tuple[int, int], str] = {}  # (prompt, sample) -> text the engine holds back
    done: set[int] = set()
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
            ended.setdefault(i, set()).update(d.index for d in out.outputs if d.finished)
            held.update(((i, d.index), d.held_text) for d in out.outputs)
            if out.finished:
                done.add(i)
            yield i, out
    for i, prompt in enumerate(prompts):
        if i not in done:
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            texts = {k: text for (j, k), text in held.items() if j == i}
            yield i, _ended_at_deadline(ended.get(i), texts, prompt, params, rid)


def _ended_at_deadline(
    ended: set[int] | None,
    held: dict[int, str],
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
) -> EngineCoreOutput:
    """The last delta of a request cut at its deadline: every sample still running ends with
    finish reason "abort" and the text the engine held back (the prompt too, when nothing came
    back yet)."""
    asked = params.logprobs is not None
    samples = [
        SampleDelta(
            k,
            held.get(k, ""),
            [],
            logprobs=[] if asked else None,
            top_logprobs=[] if asked else None,
            finish_reason="abort",
        )
        for k in range(params.n)
        if k not in (ended or ())
    ]
    prompt_ids = list(prompt) if ended is None else None
    return EngineCoreOutput(request_id, samples, True, prompt_token_ids=prompt_ids)


async def _single(
    iterator: AsyncGenerator[EngineCoreOutput, None],
) -> AsyncGenerator[Indexed, None]:
    async with aclosing(iterator):
        async for out in iterator:
            yield 0, out


async def _merge(
    iterators: list[AsyncGenerator[EngineCoreOutput, None]],
) -> AsyncGenerator[Indexed, None]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, iterator: AsyncGenerator[EngineCoreOutput, None]) -> None:
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
    """What one choice has sent so far. The engine already held back text that could become a
    stop string, so every delta's text goes out as it is."""

    sent_chars: int = 0
    started: bool = False
    done: bool = False

    def advance(self, d: SampleDelta) -> Delta | None:
        if self.done or not (d.text or d.token_ids or d.finished):
            return None
        start, first = self.sent_chars, not self.started
        self.sent_chars, self.started, self.done = start + len(d.text), True, d.finished
        return Delta(d.text, d.token_ids, d.logprobs, d.top_logprobs, start, d.finished, first)


@dataclass
class PromptSeen:
    """What a stream told about one prompt so far, kept without rebuilding cumulative outputs:
    the prompt (sent once), its logprobs, and counts for the usage chunk."""

    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    weight_version: int = 0
    finished: bool = False

    def add(self, out: EngineCoreOutput) -> None:
        if out.prompt_token_ids is not None:
            self.prompt_token_ids = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + out.prompt_logprobs
        # the highest seen: a deadline's last delta (made here) does not know it
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.completion_tokens += sum(len(d.token_ids) for d in out.outputs)
        self.weight_version = max(self.weight_version, out.weight_version)
        self.finished = out.finished
