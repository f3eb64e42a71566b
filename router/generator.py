"""How a request reaches an engine, and how the session registry gets a turn generated over it.

`Requests` is the request path, one protocol for both places an engine can be: the replicas
over Ray (`raylane.router.replica_requests.ReplicaRequests`, routed on this process's copy of
the Router's table) or one engine in this process (`raylane.router.replica_calls.LocalReplica`).
The HTTP backend, the in-cluster rollout client and the session turns all go through one.

The registry and the ingress only know `TurnGenerator`; `RequestTurnGenerator` runs a turn over
a `Requests` (unit tests inject fakes). A turn's outputs are the engine's own deltas, as they
come, all the way to the session route's socket (`turn_deltas`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Protocol

from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput, SampleDelta
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

    `generate` is an async iterator of the engine's one-choice deltas (`EngineCoreOutput`)
    ending with a finished one, whose choice carries `routed_experts` when the backend captures
    them. A model-free generator may yield cumulative `RequestOutput`s instead (each everything
    so far); `turn_deltas` reads both. Closing the iterator early aborts the generation.
    `routing_key` (the session id) keeps a session on one replica so its prefix cache is reused.
    `lora`: the LoRA adapter the session runs on (passed only when it has one).
    """

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        routing_key: str,
        lora: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput | RequestOutput, None]: ...


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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        routing_key: str,
        lora: str | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        params = turn_params(params, self.return_routed_experts, self.return_indexer_topk)
        request_id = turn_request_id(routing_key)
        if lora is None:
            return self.requests.generate(prompt_ids, params, request_id, routing_key)
        return self.requests.generate(prompt_ids, params, request_id, routing_key, lora=lora)


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


async def turn_deltas(
    outputs: AsyncGenerator[EngineCoreOutput | RequestOutput, None],
) -> AsyncGenerator[EngineCoreOutput, None]:
    """A `TurnGenerator`'s outputs as deltas: the engine's as they are; a cumulative
    `RequestOutput` (a model-free generator's) as what it added to the one before. Closing
    this closes `outputs` (which aborts the generation)."""
    before: RequestOutput | None = None
    async with aclosing(outputs):
        async for out in outputs:
            if isinstance(out, EngineCoreOutput):
                yield out
                continue
            yield _added(before, out)
            before = out


def _added(before: RequestOutput | None, out: RequestOutput) -> EngineCoreOutput:
    c = out.outputs[0]
    was = before.outputs[0] if before is not None else None
    n, chars = (len(was.token_ids), len(was.text)) if was is not None else (0, 0)
    delta = SampleDelta(
        c.index,
        c.text[chars:],
        c.token_ids[n:],
        logprobs=_tail(c.logprobs, n),
        top_logprobs=_tail(c.top_logprobs, n),
        weight_versions=c.weight_versions[n:],
        kept_mass_logprobs=_tail(c.kept_mass_logprobs, n),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        routed_experts=c.routed_experts,
        indexer_topk=c.indexer_topk,
        constrained=c.constrained,
    )
    first = before is None
    return EngineCoreOutput(
        out.request_id,
        [delta],
        out.finished,
        out.weight_version,
        out.num_cached_tokens,
        prompt=out.prompt if first else None,
        prompt_token_ids=out.prompt_token_ids if first else None,
        metrics=out.metrics or None,
        error=out.error,
    )


def _tail(values: list | None, n: int) -> list | None:
    return None if values is None else values[n:]
