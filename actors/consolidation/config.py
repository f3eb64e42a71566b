"""ConsolidationConfig: how much work one run takes per round, per LLM call, and in parallel."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ConsolidationConfig:
    """Sizes of a consolidation run.

    batch_size: memories fetched per round (oldest first).
    llm_batch_size: memories per LLM call, within one tag group.
    max_parallel_groups: tag groups consolidated concurrently (LLM calls in flight).
    """

    batch_size: int = 50
    llm_batch_size: int = 8
    max_parallel_groups: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass; True as a batch size is a mistake, not 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
