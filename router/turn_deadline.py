"""A session turn's deadline: past it the generation is aborted and the turn ends with the
output so far, finish reason "abort" — what the OpenAI routes do with `timeout`
(session_server/streaming/), enforced where the turn runs so the abort reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from raylane.actors.engine.outputs import CompletionOutput, RequestOutput, aborted
from raylane.router.errors import BadSessionRequest


async def until_deadline(
    outputs: AsyncGenerator[RequestOutput, None], timeout_s: float | None
) -> AsyncGenerator[RequestOutput, None]:
    """`outputs` as they come, for at most `timeout_s` seconds (None: no limit). At the deadline
    `outputs` is closed (which aborts the generation, see `TurnGenerator`) and one last output
    ends the turn: the partial output, finish reason "abort"."""
    if timeout_s is not None and not timeout_s > 0:
        raise BadSessionRequest(f"timeout must be > 0 seconds, got {timeout_s}", param="timeout")
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    last: RequestOutput | None = None
    async with aclosing(outputs):
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    out = await anext(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                break
            last = out
            yield out
            if out.finished:
                return
    yield ended_at_deadline(last)


def ended_at_deadline(out: RequestOutput | None) -> RequestOutput:
    """The partial output as the turn's final one. It carries no routed-expert blob: an engine
    hands one out only with a request it finished itself."""
    if out is None:  # nothing generated yet (the engine was still queueing or prefilling)
        out = RequestOutput("", None, [], [CompletionOutput(0, "", [], [])], finished=False)
    return aborted(out)
