"""Plain records passed between the store, the prompt and the consolidator."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Tags = tuple[str, ...]


def normalize_tags(tags: Iterable[str]) -> Tags:
    """Tags are compared as an exact set, so they are stored sorted and without duplicates."""
    tags = list(tags)
    if any(not isinstance(t, str) or not t for t in tags):
        raise ValueError(f"tags must be non-empty strings, got {tags!r}")
    return tuple(sorted(set(tags)))


@dataclass(frozen=True)
class Memory:
    id: int
    bank_id: str
    content: str
    tags: Tags
    created_at: datetime
    consolidated_at: datetime | None = None
    consolidation_failed_at: datetime | None = None


@dataclass(frozen=True)
class ObservationView:
    """What a prompt shows of an observation: its id and current text."""

    id: int
    text: str


@dataclass(frozen=True)
class Observation:
    id: int
    bank_id: str
    content: str
    tags: Tags
    source_memory_ids: tuple[int, ...]
    proof_count: int
    created_at: datetime
    updated_at: datetime
    history: tuple[dict, ...]


@dataclass(frozen=True)
class Action:
    """One validated action of a model's answer."""

    kind: Literal["create", "update", "skip"]
    memory_ids: tuple[int, ...]
    text: str | None = None
    observation_id: int | None = None
