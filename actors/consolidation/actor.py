"""ConsolidationActor: a Ray actor that keeps consolidation running in the background."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray

from .config import ConsolidationConfig
from .consolidator import Consolidator
from .llm import LLM
from .store import MemoryStore

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class ConsolidationActor:
    """Memories in, observations out, for many banks.

    `llm_factory` is called once inside the actor (an LLM client is rarely picklable; a factory
    such as `functools.partial(OpenAICompatibleLLM, url, model)` is).

    One run per bank at a time: `submit` for a bank that is already running returns the
    running operation's id instead of starting another. That run keeps fetching rounds until no
    memory is pending, so memories retained while it runs are consolidated by it too (one
    retained as it finishes waits for the next submit or scheduled run).
    """

    def __init__(self, dsn: str, llm_factory: Callable[[], LLM],
                 config: ConsolidationConfig | None = None) -> None:
        self._dsn = dsn
        self._llm_factory = llm_factory
        self._config = config or ConsolidationConfig()
        self._consolidator: Consolidator | None = None
        self._connecting = asyncio.Lock()
        self._running: dict[str, str] = {}           # bank id -> op id
        self._tasks: dict[str, asyncio.Task] = {}     # op id -> background run
        self._schedules: dict[str, asyncio.Task] = {}  # bank id -> periodic submitter

    async def retain(self, bank_id: str, content: str, tags: list[str] | None = None) -> int:
        consolidator = await self._ready()
        return await consolidator.store.retain(bank_id, content, tags or ())

    async def observations(self, bank_id: str, tags: list[str] | None = None) -> list[dict]:
        consolidator = await self._ready()
        return [asdict(o) for o in await consolidator.store.observations(bank_id, tags or ())]

    async def submit(self, bank_id: str) -> str:
        """Start consolidating `bank_id` in the background; returns the operation id."""
        consolidator = await self._ready()
        if bank_id in self._running:
            return self._running[bank_id]
        op_id = await consolidator.store.operations.create(bank_id)
        self._running[bank_id] = op_id
        self._tasks[op_id] = asyncio.create_task(self._run(consolidator, bank_id, op_id))
        return op_id

    async def status(self, op_id: str) -> dict[str, Any] | None:
        """The operation's row: status, stats, per-batch perf, error; None if unknown."""
        consolidator = await self._ready()
        return await consolidator.store.operations.get(op_id)

    async def cancel(self, op_id: str) -> bool:
        consolidator = await self._ready()
        return await consolidator.cancel(op_id)

    async def wait(self, op_id: str) -> dict[str, Any] | None:
        """Wait for a run this actor started, then return its status."""
        task = self._tasks.get(op_id)
        if task is not None:
            await asyncio.wait([task])
        return await self.status(op_id)

    async def schedule(self, bank_id: str, every_s: float) -> None:
        """Submit `bank_id` every `every_s` seconds (replacing an earlier schedule)."""
        if every_s <= 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        await self.unschedule(bank_id)
        self._schedules[bank_id] = asyncio.create_task(self._every(bank_id, every_s))

    async def unschedule(self, bank_id: str) -> None:
        task = self._schedules.pop(bank_id, None)
        if task is not None:
            task.cancel()

    async def metrics_text(self) -> str:
        """This process's Prometheus exposition, for a /metrics endpoint to merge."""
        from prometheus_client import generate_latest

        return generate_latest().decode()

    async def _ready(self) -> Consolidator:
        async with self._connecting:
            if self._consolidator is None:
                store = await MemoryStore.connect(self._dsn)
                self._consolidator = Consolidator(store, self._llm_factory(), self._config)
        return self._consolidator

    async def _run(self, consolidator: Consolidator, bank_id: str, op_id: str) -> None:
        try:
            await consolidator.run(bank_id, op_id)
        except Exception:  # recorded in the operation row; the actor keeps serving
            log.exception("consolidation %s of bank %r failed", op_id, bank_id)
        finally:
            del self._running[bank_id]
            del self._tasks[op_id]

    async def _every(self, bank_id: str, every_s: float) -> None:
        while True:
            try:
                await self.submit(bank_id)
            except Exception:  # e.g. database briefly down: try again next period
                log.exception("scheduled consolidation of bank %r could not start", bank_id)
            await asyncio.sleep(every_s)
