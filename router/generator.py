"""How the session registry gets a turn generated: a protocol, and its adaptor over the engine.

The registry only knows `TurnGenerator`; the Router actor injects one that calls a replica, unit
tests inject fakes, and `EngineTurnGenerator` runs an in-process `AsyncLLMEngine`. A turn's
outputs are the engine's own `RequestOutput`s (one choice).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from raylane.actors.engine.outputs import RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams


class TurnGenerator(Protocol):
    """Generates one turn from token ids.

    `generate` is an async iterator of cumulative one-choice `RequestOutput`s ending with a
    finished one, whose choice carries `routed_experts` when the backend captures them. Closing
    the iterator early aborts the generation. `routing_key` (the session id) keeps a session on
    one replica so its prefix cache is reused.
    """

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, routing_key: str
    ) -> AsyncGenerator[RequestOutput, None]: ...


class EngineTurnGenerator:
    """`TurnGenerator` over an in-process `AsyncLLMEngine`.

    Pass `return_routed_experts=True` for an MoE engine started with
    `EngineConfig(enable_return_routed_experts=True)`.
    """

    def __init__(
        self, engine: Any, return_routed_experts: bool = False, return_indexer_topk: bool = False
    ) -> None:
        self.engine = engine
        self.return_routed_experts = return_routed_experts
        self.return_indexer_topk = return_indexer_topk

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, routing_key: str
    ) -> AsyncGenerator[RequestOutput, None]:
        params = turn_params(params, self.return_routed_experts, self.return_indexer_topk)
        return self._outputs(prompt_ids, params, turn_request_id(routing_key), routing_key)

    def _outputs(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, routing_key: str
    ) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.generate(prompt_ids, params, request_id)


def turn_params(
    params: SamplingParams, return_routed_experts: bool, return_indexer_topk: bool = False
) -> SamplingParams:
    """The engine request for a turn: logprobs always (training needs them), routed experts
    and indexer top-k as the engine is set up to capture them."""
    return dataclasses.replace(
        params,
        return_routed_experts=return_routed_experts,
        return_indexer_topk=return_indexer_topk,
        logprobs=0 if params.logprobs is None else params.logprobs,
    )


def turn_request_id(routing_key: str) -> str:
    return f"{routing_key}-{secrets.token_hex(6)}"
