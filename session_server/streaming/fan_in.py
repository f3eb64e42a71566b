"""One HTTP request's backend streams, merged: one per prompt, each item tagged with its prompt
index, and cut at the request's deadline (the still-running samples end "abort")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server.backend import EngineBackend

Indexed = tuple[int, EngineCoreOutput]  # (prompt index, what the step added)


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
