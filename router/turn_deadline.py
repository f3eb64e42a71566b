"""A session turn's deadline: past it the generation is aborted and the turn ends with the
output so far, finish reason "abort" — what the OpenAI routes do with `timeout`
(session_server/streaming/), enforced where the turn runs so the abort reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta
from raylane.router.errors import BadSessionRequest


async def until_deadline(
    deltas: AsyncGenerator[EngineCoreOutput, None], timeout_s: float | None
) -> AsyncGenerator[EngineCoreOutput, None]:
    """`deltas` as they come, for at most `timeout_s` seconds (None: no limit). At the deadline
    `deltas` is closed (which aborts the generation, see `TurnGenerator`) and one last delta
    ends the turn: nothing added, finish reason "abort"."""
    if timeout_s is not None and not timeout_s > 0:
        raise BadSessionRequest(f"timeout must be > 0 seconds, got {timeout_s}", param="timeout")
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    async with aclosing(deltas):
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(deltas)
            except StopAsyncIteration:
                return
            except TimeoutError:
                break
            yield delta
            if delta.finished:
                return
    yield ended_at_deadline()


def ended_at_deadline() -> EngineCoreOutput:
    """The turn's last delta at its deadline: nothing added, finish reason "abort". It carries
    no routed-expert blob (an engine hands one out only with a request it finished itself) and
    none of the text held back for stop strings (the turn records what it sent)."""
    return EngineCoreOutput("", [SampleDelta(0, "", [], [], finish_reason="abort")], finished=True)
