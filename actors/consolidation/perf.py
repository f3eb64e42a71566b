"""BatchPerf: the counters and timings of one LLM batch, and their merge into run totals."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from .records import Tags


@dataclass
class BatchPerf:
    """One batch's own record. Concurrent batches never share one, so nothing races; the
    consolidator merges them when the run ends."""

    tags: Tags = ()
    memories: int = 0
    consolidated: int = 0  # memories stamped consolidated_at
    failed: int = 0  # memories stamped consolidation_failed_at
    created: int = 0  # observations created
    updated: int = 0  # observations updated
    skipped: int = 0  # memories consolidated without an observation
    llm_calls: int = 0
    failed_calls: int = 0  # calls answered invalidly or rejected (each one splits the batch)
    prompt_chars: int = 0
    db_round_trips: int = 0
    llm_seconds: float = 0.0
    db_seconds: float = 0.0
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"tags": list(self.tags), **{name: getattr(self, name) for name in NUMERIC_FIELDS}}


NUMERIC_FIELDS = tuple(f.name for f in fields(BatchPerf) if f.name != "tags")


def merge_perf(records: Iterable[BatchPerf]) -> BatchPerf:
    """One record whose every counter and timing is the sum over `records`."""
    total = BatchPerf()
    for record in records:
        for name in NUMERIC_FIELDS:
            setattr(total, name, getattr(total, name) + getattr(record, name))
    return total


@dataclass(frozen=True)
class ConsolidationResult:
    """What a run did: its status, the merged total and the per-batch records.

    `total.created`, `.updated`, `.skipped`, `.failed`, `.consolidated`, `.llm_calls`, ... are
    the run's stats; `total.wall_seconds` sums batch times, `wall_seconds` is the run's own.
    """

    op_id: str
    bank_id: str
    status: str  # completed | cancelled (a failed run raises instead)
    wall_seconds: float
    batches: tuple[BatchPerf, ...]

    @property
    def total(self) -> BatchPerf:
        return merge_perf(self.batches)

    def stats(self) -> dict[str, Any]:
        """The JSON stored in the operation's `stats` column."""
        total = self.total.to_dict()
        del total["tags"]
        return {
            "status": self.status,
            "wall_seconds": self.wall_seconds,
            "batches": len(self.batches),
            **total,
        }
