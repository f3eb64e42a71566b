"""How the session registry gets a turn generated: a protocol, and its adaptor over the engine.

The registry only knows `TurnGenerator`; the Router actor injects one that calls a replica, unit
tests inject fakes, and `EngineTurnGenerator` runs an in-process `AsyncLLMEngine`.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from actors.engine.outputs import RequestOutput
from actors.engine.sampling_params import SamplingParams


@dataclass
class TurnOutput:
    """One turn's output so far (cumulative); `finish_reason` is set on the last one."""

    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each token in `token_ids`
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort"
    weight_version: int = 0
    routed_experts: np.ndarray | None = None  # int32 [prompt + output - 1, moe_layers, top_k]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TurnGenerator(Protocol):
    """Generates one turn from token ids.

    `generate` is an async iterator of cumulative `TurnOutput`s ending with a finished one,
    which carries `routed_experts` when the backend captures them. Closing the iterator early
    aborts the generation. `routing_key` (the session id) keeps a session on one replica so its
    prefix cache is reused.
    """

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 routing_key: str) -> AsyncIterator[TurnOutput]: ...


class EngineTurnGenerator:
    """`TurnGenerator` over an in-process `AsyncLLMEngine`.

    Pass `return_routed_experts=True` for an MoE engine started with
    `EngineConfig(enable_return_routed_experts=True)`.
    """

    def __init__(self, engine: Any, return_routed_experts: bool = False) -> None:
        self.engine = engine
        self.return_routed_experts = return_routed_experts

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       routing_key: str) -> AsyncIterator[TurnOutput]:
        params = turn_params(params, self.return_routed_experts)
        outputs = self._outputs(prompt_ids, params, turn_request_id(routing_key), routing_key)
        # aclosing: leaving this iterator early must abort the request now, not at GC
        async with aclosing(outputs):
            async for out in outputs:
                yield turn_output(out)

    def _outputs(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 routing_key: str) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(prompt_ids, params, request_id)


def turn_params(params: SamplingParams, return_routed_experts: bool) -> SamplingParams:
    """The engine request for a turn: logprobs always (training needs them), routed experts
    as the engine is set up to capture them."""
    return dataclasses.replace(params, return_routed_experts=return_routed_experts,
                               logprobs=0 if params.logprobs is None else params.logprobs)


def turn_request_id(routing_key: str) -> str:
    return f"{routing_key}-{secrets.token_hex(6)}"


def turn_output(out: RequestOutput) -> TurnOutput:
    c = out.outputs[0]
    return TurnOutput(token_ids=list(c.token_ids), logprobs=list(c.logprobs or []), text=c.text,
                      finish_reason=c.finish_reason, weight_version=out.weight_version,
                      routed_experts=c.routed_experts)
