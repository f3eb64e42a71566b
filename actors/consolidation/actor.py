"""ConsolidationActor: a Ray actor that keeps consolidation running in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest

from .config import ConsolidationConfig
from .consolidator import Consolidator
from .llm import LLM
from .metrics import ConsolidationMetrics
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

    With `every_s`, the actor runs a pass (see `run_pass`) over `banks` (None: every bank with
    pending memories) at once and then `every_s` seconds after each pass ends. It is set up in
    the constructor, so an actor Ray restarts resumes its passes.
    """

    def __init__(
        self,
        dsn: str,
        llm_factory: Callable[[], LLM],
        config: ConsolidationConfig | None = None,
        *,
        every_s: float | None = None,
        banks: Sequence[str] | None = None,
    ) -> None:
        self._dsn = dsn
        self._llm_factory = llm_factory
        self._config = config or ConsolidationConfig()
        # Its own registry: /metrics merges exactly these families, not this process's others.
        self._registry = CollectorRegistry()
        self._metrics = ConsolidationMetrics(self._registry)
        self._consolidator: Consolidator | None = None
        self._connecting = asyncio.Lock()
        self._running: dict[str, str] = {}  # bank id -> op id
        self._tasks: dict[str, asyncio.Task] = {}  # op id -> background run
        self._schedules: dict[str, asyncio.Task] = {}  # bank id -> periodic submitter
        self._passes = None if every_s is None else self._start_passes(banks, every_s)

    async def connect(self) -> None:
        """Connect to the database (applying migrations) now instead of on first use."""
        await self._ready()

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

    async def run_pass(self, banks: list[str] | None = None) -> dict[str, str]:
        """Consolidate each of `banks` (None: every bank) that has pending memories, one bank
        after another, so at most `max_parallel_groups` LLM calls are ever in flight.

        Returns bank id -> the run's status; counted in `raylane:consolidation_passes_total`
        (failed when a run failed or the pass could not start) and the last pass's duration.
        """
        started = time.perf_counter()
        statuses: dict[str, str] = {}
        try:
            consolidator = await self._ready()
            for bank_id in await consolidator.store.pending_banks(banks):
                row = await self.wait(await self.submit(bank_id))
                statuses[bank_id] = row["status"] if row else "unknown"
        except Exception:  # a cancelled pass (actor shutdown) is not counted as failed
            self._metrics.record_pass(False, time.perf_counter() - started)
            raise
        ok = all(status != "failed" for status in statuses.values())
        self._metrics.record_pass(ok, time.perf_counter() - started)
        return statuses

    async def metrics_text(self) -> str:
        """This actor's consolidation metrics (Prometheus text), for a /metrics to merge."""
        return generate_latest(self._registry).decode()

    async def _ready(self) -> Consolidator:
        async with self._connecting:
            if self._consolidator is None:
                store = await MemoryStore.connect(self._dsn)
                self._consolidator = Consolidator(
                    store, self._llm_factory(), self._config, metrics=self._metrics
                )
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

    def _start_passes(self, banks: Sequence[str] | None, every_s: float) -> asyncio.Task:
        if every_s <= 0:
            raise ValueError(f"every_s must be positive, got {every_s}")
        # NOTE: Ray runs an async actor's constructor on the actor's event loop
        return asyncio.get_running_loop().create_task(
            self._pass_every(None if banks is None else list(banks), every_s)
        )

    async def _pass_every(self, banks: list[str] | None, every_s: float) -> None:
        while True:
            try:
                await self.run_pass(banks)
            except Exception:  # e.g. the database briefly down: counted, tried again next time
                log.exception("consolidation pass failed; the next starts in %.0f s", every_s)
            await asyncio.sleep(every_s)
