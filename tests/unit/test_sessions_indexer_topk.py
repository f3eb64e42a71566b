"""Indexer top-k blobs (DSA) in session records: kept like routed experts (the newest
rollback + 1 records hold them, so memory stays O(prefix) over 64 sessions x 50 turns), left
out of replies, merged into the training sample from the last turn, and stored by the codec."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from raylane.router.samples import TrainingSample, merge_trajectory
from raylane.router.session_codec import decode_session, encode_session
from raylane.router.sessions import SessionConfig

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import Agent, make_registry, user

SYSTEM = {"role": "system", "content": "You answer briefly."}
TOPK = 4


def prefix_picks(prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """A stand-in selection, a pure function of the prefix: position p picks the TOPK
    positions before it (or all of them), ascending, -1 padded; [len - 1, 2 layers, TOPK]."""
    pos = np.arange(len(prompt_ids) + len(output_ids) - 1)[:, None]  # [n, 1]
    j = np.arange(TOPK)[None, :]
    rows = np.where(j <= pos, j + np.maximum(0, pos + 1 - TOPK), -1).astype(np.int32)
    return np.repeat(rows[:, None, :], 2, axis=1)  # the same picks on both layers


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def test_records_window_replies_samples_and_codec(tok):
    registry, _ = make_registry(tok, SessionConfig(max_rollback_steps=1), picks=prefix_picks)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("turn 0"))
    for turn in range(1, 5):
        await agent.user(f"turn {turn}")
    session = await registry.get(agent.id)
    records = session.trajectory.records
    held = [r.indexer_topk is not None for r in records]
    assert held == [False, False, False, True, True]  # rollback 1: the last two
    assert all(r.blobs_dropped for r in records[:3])
    last = records[-1]
    assert last.indexer_topk.shape == (last.end - 1, 2, TOPK)
    sample = merge_trajectory(records)
    np.testing.assert_array_equal(sample.indexer_topk, prefix_picks(sample.tokens, []))
    again = TrainingSample.from_safetensors(sample.to_safetensors())
    np.testing.assert_array_equal(again.indexer_topk, sample.indexer_topk)
    assert sample.to_json()["indexer_topk"]["shape"] == [len(sample.tokens) - 1, 2, TOPK]
    stored = decode_session(encode_session(session))
    np.testing.assert_array_equal(stored.trajectory.records[-1].indexer_topk, last.indexer_topk)
    assert records[-1].to_dict()["indexer_topk_shape"] == [last.end - 1, 2, TOPK]


async def test_64_sessions_by_50_turns_retain_o_prefix(tok):
    """Both blobs, window rollback 0 + 1: what the registry retains never exceeds one record's
    blobs per session, however many turns ran."""
    registry, gen = make_registry(tok, SessionConfig(max_rollback_steps=0), picks=prefix_picks)
    gen.keep_prompts = False
    peak = 0

    async def session() -> str:
        nonlocal peak
        agent = await Agent.start(registry)
        await agent.say(SYSTEM, user("turn 0"))
        for turn in range(1, 50):
            await agent.user(f"turn {turn}")
            if turn % 10 == 0:  # the sum walks every record: not after every turn
                peak = max(peak, registry.retained_blob_bytes())
        return agent.id

    ids = await asyncio.gather(*(session() for _ in range(64)))
    final = [await registry.get(sid) for sid in ids]
    longest = max(s.trajectory.records[-1].end for s in final)
    # per session one record: routing [end - 1, 2, 2] + picks [end - 1, 2, TOPK], int32
    assert peak <= 64 * (longest - 1) * (2 * 2 + 2 * TOPK) * 4
    for s in final:
        assert [r.indexer_topk is not None for r in s.trajectory.records] == [False] * 49 + [True]
