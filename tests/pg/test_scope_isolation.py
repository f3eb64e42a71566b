"""Property: tags are a security boundary, for any assignment of tags to memories."""

from __future__ import annotations

import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raylane.actors.consolidation import ConsolidationConfig, Consolidator, MemoryStore

from tests.pg.checks import assert_each_memory_once
from tests.support.fake_llm import FakeLLM

tag_sets = st.lists(st.sampled_from(["alice", "bob", "team", "x"]), max_size=3)


async def _consolidate(
    store: MemoryStore, bank: str, tags: list[list[str]], config, metrics
) -> FakeLLM:
    await store.retain_many(bank, [(f"memory {i}", t) for i, t in enumerate(tags)])
    llm = FakeLLM()
    await Consolidator(store, llm, config, metrics=metrics).run(bank)
    return llm


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    first=st.lists(tag_sets, min_size=1, max_size=20),
    second=st.lists(tag_sets, min_size=1, max_size=20),
    batch_size=st.integers(1, 12),
    llm_batch_size=st.integers(1, 5),
    parallel=st.integers(1, 4),
)
async def test_no_call_mixes_scopes(
    store, metrics, first, second, batch_size, llm_batch_size, parallel
) -> None:
    bank, neighbour = f"prop-{uuid.uuid4().hex}", f"prop-{uuid.uuid4().hex}"
    config = ConsolidationConfig(
        batch_size=batch_size, llm_batch_size=llm_batch_size, max_parallel_groups=parallel
    )
    # The neighbour bank has observations under the very same tag sets: never to be shown.
    await _consolidate(store, neighbour, first + second, config, metrics)
    # Two waves, so the second wave's calls are shown the first wave's observations.
    calls = (await _consolidate(store, bank, first, config, metrics)).calls
    calls += (await _consolidate(store, bank, second, config, metrics)).calls

    scope_of = {
        o.id: (o.bank_id, o.tags)
        for b in (bank, neighbour)
        for o in await store.all_observations(b)
    }
    for call in calls:
        assert len(call.tag_sets) == 1, f"a call mixed tag sets: {call.tag_sets}"
        (tags,) = call.tag_sets
        assert list(tags) == sorted(set(tags))
        assert len(call.memory_ids) <= llm_batch_size
        for observation_id in call.observation_ids:
            assert scope_of[observation_id] == (bank, tags), "observation shown outside scope"
    await assert_each_memory_once(store, bank)
