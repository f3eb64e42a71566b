"""What the HTTP layer needs from the cluster, as a small protocol the layer above injects.

`build_app(backend)` only talks to an `EngineBackend`; `LocalBackend` runs one AsyncLLMEngine in
process (tests, single-process serving) and `cluster.serve` provides one over the Router actor
and the Ray Serve engine replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from actors.engine.outputs import RequestOutput
from actors.engine.sampling_params import SamplingParams


class QueueFull(Exception):
    """Every replica's queue is full: answer 429 with Retry-After."""

    def __init__(self, retry_after: float = 1.0):
        super().__init__("all engine replicas are busy; retry later")
        self.retry_after = retry_after


class ReplicaFailed(Exception):
    """The replica serving a request died or failed mid-request (a clean 5xx, never a hang)."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients send as "model"
    max_model_len: int
    vocab_size: int


class EngineBackend(Protocol):
    """The engine side of the HTTP surface."""

    info: ModelInfo
    tokenizer: object  # a transformers tokenizer (chat template, encode/decode) loaded locally

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 routing_key: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing the iterator early aborts it.

        Raises `ValueError` for bad input, `QueueFull` and `ReplicaFailed` as above.
        """
        ...

    async def ready(self) -> bool:
        """True when at least one replica can serve."""
        ...

    async def stats(self) -> list[dict]:
        """One `EngineStats.snapshot()` per live replica, for /metrics."""
        ...


class LocalBackend:
    """One in-process AsyncLLMEngine behind the protocol."""

    def __init__(self, engine, model_name: str):
        from actors.engine.async_engine import AsyncLLMEngine

        self.engine: AsyncLLMEngine = engine
        self.tokenizer = engine.tokenizer
        cfg = engine.engine.config
        self.info = ModelInfo(model_name, cfg.max_model_len, engine.engine.validator.vocab_size)

    async def generate(self, prompt_ids, params, request_id, routing_key=None):
        try:
            self.engine.check_health()
        except RuntimeError as e:
            raise ReplicaFailed(str(e)) from e
        async with contextlib.aclosing(self.engine.generate(prompt_ids, params, request_id)) as it:
            async for out in it:
                yield out

    async def ready(self) -> bool:
        try:
            self.engine.check_health()
        except RuntimeError:
            return False
        return True

    async def stats(self) -> list[dict]:
        return [self.engine.stats_snapshot()]
