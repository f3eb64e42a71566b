"""A turn's generation as it goes: the engine's deltas, passed on as they come (`TurnRun`), and
the cumulative view of them for callers that want every output so far (`turn_results`,
`CumulativeTurns.chat_stream`).

The session route sends the deltas to its socket as they are; the registry (in process) and
the ingress (for the Router) fold them once, into the finished output the session records.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.generator import turn_deltas
from raylane.router.messages import Message
from raylane.router.session import TurnDelta, TurnResult
from raylane.router.turn_deadline import until_deadline


class TurnRun:
    """One turn's generation: `outputs` (a `TurnGenerator`'s) for at most `timeout_s` seconds
    (past it: aborted, finish reason "abort"). `progress` yields its unfinished deltas;
    once it is `finished`, `output` is the finished output and `ended` the last step."""

    def __init__(
        self,
        outputs: AsyncGenerator,
        prompt_len: int,
        rolled_back: int,
        timeout_s: float | None,
    ) -> None:
        self.outputs = outputs
        self.prompt_len = prompt_len
        self.rolled_back = rolled_back
        self.timeout_s = timeout_s
        self._folded = OutputAccumulator()
        self._last: EngineCoreOutput | None = None  # the finished delta

    async def progress(self) -> AsyncGenerator[TurnDelta, None]:
        """The deltas before the finished one. Closing it early aborts the generation."""
        deltas = until_deadline(turn_deltas(self.outputs), self.timeout_s)
        async with aclosing(deltas):
            async for delta in deltas:
                self._folded.add(delta)
                if delta.finished:
                    self._last = delta
                    return
                yield TurnDelta(delta, self.prompt_len, self.rolled_back)

    @property
    def finished(self) -> bool:
        """Whether `progress` ran out at the finished delta (not at the stream's end)."""
        return self._last is not None

    def output(self) -> RequestOutput:
        """The finished output: every delta folded in."""
        assert self._last is not None  # the caller checked `finished`
        return self._folded.output()

    def ended(self, committed: TurnResult) -> TurnDelta:
        """The turn's last step: its finished delta, with the result the session committed."""
        assert self._last is not None
        return TurnDelta(self._last, committed.prompt_len, committed.rolled_back, committed)


async def turn_results(steps: AsyncGenerator[TurnDelta, None]) -> AsyncGenerator[TurnResult, None]:
    """A turn's steps as `TurnResult`s: cumulative progress (every output so far), then the
    committed result. Closing it closes `steps`."""
    folded = OutputAccumulator()
    async with aclosing(steps):
        async for step in steps:
            if step.committed is not None:
                yield step.committed
                continue
            folded.add(step.delta)
            out = folded.output()
            yield TurnResult(out.outputs[0], out.weight_version, step.prompt_len, step.rolled_back)


class CumulativeTurns:
    """`chat_stream` for a session backend that runs turns as deltas (`chat_deltas`)."""

    def chat_deltas(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        lora_version: int | None = None,
    ) -> AsyncGenerator[TurnDelta, None]:
        raise NotImplementedError

    def chat_stream(
        self,
        session_id: str,
        messages: list[Message],
        params: SamplingParams | None = None,
        **options: Any,
    ) -> AsyncGenerator[TurnResult, None]:
        """The turn of `chat_deltas` (the same arguments) as cumulative progress (every output
        so far), then the committed result."""
        return turn_results(self.chat_deltas(session_id, messages, params, **options))
