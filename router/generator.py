"""How a request reaches an engine, and how the session registry gets a turn generated over it.

`Requests` is the request path, one protocol for both places an engine can be: the replicas
over Ray (`raylane.router.replica_requests.ReplicaRequests`, routed on this process's copy of
the Router's table) or one engine in this process (`raylane.router.replica_calls.LocalReplica`).
The HTTP backend, the in-cluster rollout client and the session turns all go through one.

The registry only knows `TurnGenerator`; `RequestTurnGenerator` runs a turn over a `Requests`
(the Router injects a `TurnHandoff` instead, and unit tests inject fakes). A turn's outputs are
the engine's own `RequestOutput`s (one choice), built from its deltas.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncGenerator
from typing import Protocol

from raylane.actors.engine.output_accumulator import cumulative
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams


class Requests(Protocol):
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        routing_key: str | None = None,
        lora: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """The engine's deltas for one request (what each step added; the prompt on the
        first); closing the iterator early aborts it. `routing_key` keeps a conversation on
        one replica; `lora` names the adapter the request runs on (None: the base model).

        Raises `ValueError` for bad input, `raylane.router.errors.ReplicasBusy` (429) and
        `ReplicaFailed` (503).
        """
        ...

    async def ready(self) -> bool:
        """True when at least one replica can serve."""
        ...

    async def stats(self) -> list[dict]:
        """One `EngineStats.snapshot()` per live replica, for /metrics."""
        ...


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


class RequestTurnGenerator:
    """`TurnGenerator` over a `Requests`, sticky by session id.

    Pass `return_routed_experts=True` for an MoE engine started with
    `EngineConfig(enable_return_routed_experts=True)` (likewise indexer top-k for DSA).
    """

    def __init__(
        self,
        requests: Requests,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
    ) -> None:
        self.requests = requests
        self.return_routed_experts = return_routed_experts
        self.return_indexer_topk = return_indexer_topk

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, routing_key: str
    ) -> AsyncGenerator[RequestOutput, None]:
        params = turn_params(params, self.return_routed_experts, self.return_indexer_topk)
        request_id = turn_request_id(routing_key)
        return cumulative(self.requests.generate(prompt_ids, params, request_id, routing_key))


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
