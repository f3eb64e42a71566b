"""Assertions about the end state of a bank, shared by the PostgreSQL tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from raylane.actors.consolidation import MemoryStore


async def assert_each_memory_once(
    store: MemoryStore, bank_id: str, *, failed: Collection[int] = (), skipped: Collection[int] = ()
) -> None:
    """Every memory is stamped exactly one way, and (unless failed or skipped) is the source of
    exactly one observation of its own scope, through exactly one history entry."""
    memories = await store.memories(bank_id)
    observations = await store.all_observations(bank_id)
    sources = Counter(i for o in observations for i in o.source_memory_ids)
    history = Counter(i for o in observations for h in o.history for i in h["memory_ids"])
    tags_of = {m.id: m.tags for m in memories}
    for o in observations:
        assert all(tags_of[i] == o.tags for i in o.source_memory_ids), f"scope leak in {o}"
    for m in memories:
        if m.id in failed:
            assert m.consolidation_failed_at and m.consolidated_at is None, m
        else:
            assert m.consolidated_at and m.consolidation_failed_at is None, m
        expected = 0 if m.id in failed or m.id in skipped else 1
        assert sources[m.id] == expected, (m, sources[m.id])
        assert history[m.id] == expected, (m, history[m.id])


async def assert_one_observation_per_scope(store: MemoryStore, bank_id: str) -> None:
    """The fake LLM folds a scope into its first observation: a second one is a duplicate."""
    observations = await store.all_observations(bank_id)
    scopes = Counter(o.tags for o in observations)
    assert all(n == 1 for n in scopes.values()), scopes
