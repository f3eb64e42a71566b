"""Consolidator: fold a bank's pending memories into observations, one tag group at a time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .config import ConsolidationConfig
from .errors import BankBusy, CallFailed
from .grouping import chunked, group_by_tags
from .llm import LLM
from .metrics import ConsolidationMetrics, default_metrics
from .perf import BatchPerf, ConsolidationResult
from .prompt import answer_format, build_messages, parse_answer
from .records import Action, Memory, ObservationView, Tags
from .scope import ScopeSnapshot, TagScope
from .store import MemoryStore

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _RunState:
    """What the concurrent group tasks of one run share: why to stop, and the batch records."""

    op_id: str
    bank_id: str
    cancelled: bool = False
    error: Exception | None = None
    batches: list[BatchPerf] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.error is not None

    def fail(self, exc: Exception) -> None:
        if self.error is None:  # the first error is the one reported
            self.error = exc


class Consolidator:
    """`await Consolidator(store, llm, config).run(bank_id)` consolidates until none is pending.

    Tag groups run concurrently (at most `max_parallel_groups`); the batches of one group run
    one after another, each reading the scope's observations fresh. Every batch commits alone.
    """

    def __init__(
        self,
        store: MemoryStore,
        llm: LLM,
        config: ConsolidationConfig | None = None,
        *,
        metrics: ConsolidationMetrics | None = None,
    ) -> None:
        self.store = store
        self.llm = llm
        self.config = config or ConsolidationConfig()
        self.metrics = metrics or default_metrics()
        self._runs: dict[str, _RunState] = {}

    async def run(self, bank_id: str, op_id: str | None = None) -> ConsolidationResult:
        """Run (or, given `op_id` from `store.operations.create`, carry out) one operation.

        Returns the result when completed or cancelled; records the operation failed and
        re-raises when anything unexpected goes wrong (committed batches stay committed).
        """
        if op_id is None:
            op_id = await self.store.operations.create(bank_id)
        state = _RunState(op_id, bank_id)
        self._runs[op_id] = state
        try:
            async with self.store.bank_lock(bank_id):
                return await self._run_locked(state)
        except BankBusy as exc:
            await self._record_failure(state, exc)
            raise
        finally:
            del self._runs[op_id]

    async def _run_locked(self, state: _RunState) -> ConsolidationResult:
        # Raises ValueError for an op that is not this bank's or not pending: not ours to mark.
        await self.store.operations.start(state.op_id, state.bank_id)
        try:
            await self._rounds(state)
        except BaseException as exc:
            await self._record_failure(state, exc)
            raise
        # Recorded under the lock, so the next run never sees this op still 'running'.
        return await self._finish(state, "cancelled" if state.cancelled else "completed")

    async def cancel(self, op_id: str) -> bool:
        """Ask a run to stop before its next LLM call; True if it was pending or running."""
        state = self._runs.get(op_id)
        if state is not None:  # in this process: effective before the flag reaches the table
            state.cancelled = True
        flagged = await self.store.operations.request_cancel(op_id)
        return flagged or state is not None

    async def _rounds(self, state: _RunState) -> None:
        while not state.stopped:
            memories = await self.store.pending(state.bank_id, self.config.batch_size)
            if not memories:
                return
            groups = group_by_tags(memories)
            snapshots = await self.store.snapshots(state.bank_id, list(groups), state.op_id)
            limit = asyncio.Semaphore(self.config.max_parallel_groups)
            await asyncio.gather(
                *(
                    self._group(state, limit, tags, group, snapshots[tags])
                    for tags, group in groups.items()
                )
            )
            if state.error is not None:
                raise state.error

    async def _group(
        self,
        state: _RunState,
        limit: asyncio.Semaphore,
        tags: Tags,
        memories: list[Memory],
        snapshot: ScopeSnapshot,
    ) -> None:
        async with limit:
            scope = self.store.scope(state.bank_id, tags, state.op_id)
            try:
                for batch in chunked(memories, self.config.llm_batch_size):
                    if state.stopped:
                        return
                    perf, snapshot = await self._batch(state, scope, batch, snapshot)
                    state.batches.append(perf)
            except Exception as exc:  # noqa: BLE001 - re-raised by _rounds after the gather
                # Other groups finish their in-flight batch, then stop at their next check.
                state.fail(exc)

    async def _batch(
        self, state: _RunState, scope: TagScope, memories: Sequence[Memory], snapshot: ScopeSnapshot
    ) -> tuple[BatchPerf, ScopeSnapshot]:
        """Consolidate one batch; `snapshot` is the scope as the previous statement left it,
        and the scope as this batch leaves it is returned for the next."""
        perf = BatchPerf(tags=scope.tags, memories=len(memories))
        trips, started = scope.round_trips, time.perf_counter()
        snapshot = await self._attempt(state, scope, memories, snapshot, perf)
        perf.wall_seconds = time.perf_counter() - started
        perf.db_round_trips = scope.round_trips - trips  # the group's batches run serially
        self.metrics.record_batch(perf)
        return perf, snapshot

    async def _attempt(
        self,
        state: _RunState,
        scope: TagScope,
        memories: Sequence[Memory],
        snapshot: ScopeSnapshot,
        perf: BatchPerf,
    ) -> ScopeSnapshot:
        """One LLM call for `memories` and its commit; on a failed call, split and retry.

        Returns the scope's snapshot after the last statement, for the next call.
        """
        state.cancelled = state.cancelled or snapshot.cancelled
        if state.stopped:  # checked before every LLM call
            return snapshot
        try:
            actions = await self._ask(memories, snapshot.observations, perf)
        except CallFailed as exc:
            perf.failed_calls += 1
            return await self._split(state, scope, memories, snapshot, perf, exc)
        commit = await self._db(perf, scope.commit([m.id for m in memories], actions))
        perf.created += commit.created
        perf.updated += commit.updated
        perf.consolidated += len(memories)
        perf.skipped += sum(len(a.memory_ids) for a in actions if a.kind == "skip")
        return commit.snapshot

    async def _split(
        self,
        state: _RunState,
        scope: TagScope,
        memories: Sequence[Memory],
        snapshot: ScopeSnapshot,
        perf: BatchPerf,
        exc: CallFailed,
    ) -> ScopeSnapshot:
        if len(memories) == 1:
            log.warning("memory %s failed consolidation: %s", memories[0].id, exc)
            perf.failed += 1
            return await self._db(perf, scope.mark_failed(memories[0].id))
        half = (len(memories) + 1) // 2
        snapshot = await self._attempt(state, scope, memories[:half], snapshot, perf)
        return await self._attempt(state, scope, memories[half:], snapshot, perf)

    async def _ask(
        self, memories: Sequence[Memory], observations: list[ObservationView], perf: BatchPerf
    ) -> list[Action]:
        messages = build_messages(memories, observations)
        response_format = answer_format([m.id for m in memories], [o.id for o in observations])
        perf.llm_calls += 1
        perf.prompt_chars += sum(len(m["content"]) for m in messages)
        started = time.perf_counter()
        try:
            text = await self.llm.complete(messages, response_format=response_format)
        finally:
            perf.llm_seconds += time.perf_counter() - started
        return parse_answer(text, [m.id for m in memories], [o.id for o in observations])

    @staticmethod
    async def _db(perf: BatchPerf, work: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await work
        finally:
            perf.db_seconds += time.perf_counter() - started

    async def _finish(
        self, state: _RunState, status: str, error: str | None = None
    ) -> ConsolidationResult:
        result = ConsolidationResult(
            state.op_id,
            state.bank_id,
            status,
            time.perf_counter() - state.started,
            tuple(state.batches),
        )
        await self.store.operations.finish(
            state.op_id, status, result.stats(), [b.to_dict() for b in result.batches], error
        )
        self.metrics.record_run(status)
        return result

    async def _record_failure(self, state: _RunState, exc: BaseException) -> None:
        # An outside task cancellation (actor shutdown) is a cancel, not a failure.
        status = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
        try:
            await self._finish(state, status, error=f"{type(exc).__name__}: {exc}")
        except Exception:  # never hide the original error behind a bookkeeping one
            log.exception("could not record the end of consolidation %s", state.op_id)
