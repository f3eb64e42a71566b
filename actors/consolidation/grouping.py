"""Splitting a round of memories into tag groups and LLM batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from .records import Memory, Tags

T = TypeVar("T")


def group_by_tags(memories: Sequence[Memory]) -> dict[Tags, list[Memory]]:
    """Memories grouped by their exact (sorted) tag set; groups and members keep input order."""
    groups: dict[Tags, list[Memory]] = {}
    for memory in memories:
        groups.setdefault(memory.tags, []).append(memory)
    return groups


def chunked(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """Consecutive slices of at most `size` items."""
    return [items[i : i + size] for i in range(0, len(items), size)]
