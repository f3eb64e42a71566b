"""The lease protocol between a caller process and the actors that hold state for it
(actors/leases.py): the holder's `LeaseTable` and the caller's `LeaseRenewals`, which the
replicas' output channels and the Router's session turns both use (their own tests:
test_replica_channels.py, test_turn_lease.py).

Reference: the keys a test grants, renews and holds, and the calls a fake holder records."""

from __future__ import annotations

import asyncio

import pytest
from raylane.actors.leases import LeaseLapsed, LeaseRenewals, LeaseTable


async def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for `condition()` (generous: the test fails only if it never holds)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_table_lapses_what_was_not_renewed_and_ignores_unknown_keys():
    table = LeaseTable(lease_s=3600.0)
    table.grant("a")
    table.grant("b")
    assert table.lapsed() == []  # fresh
    await asyncio.sleep(0.5)
    table.renew(["a", "never-granted"])
    assert "never-granted" not in table
    assert table.lapsed(lease_s=0.25) == ["b"]  # a was renewed just now
    table.drop("b")
    assert "b" not in table and "b" not in table.lapsed(lease_s=0.0)


async def test_a_held_result_arrives_unless_its_lease_lapses_first():
    table = LeaseTable(lease_s=3600.0)
    table.grant("kept")
    result = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(result.set_result, 42)
    assert await table.until_lapsed("kept", result) == 42

    table = LeaseTable(lease_s=0.05)
    table.grant("orphan")  # never renewed, its result never set
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(LeaseLapsed):
        await asyncio.wait_for(table.until_lapsed("orphan", never), 30)
    assert not never.cancelled()  # left to its owner


async def test_renewals_batch_the_keys_held_at_each_holder():
    calls: dict[str, list[list[str]]] = {"r1": [], "r2": []}

    def holder(name: str):
        async def renew(keys: list[str]) -> None:
            calls[name].append(keys)

        return renew

    renewals = LeaseRenewals(renew_s=0.01)
    renewals.hold("c2", "r1", holder("r1"))
    renewals.hold("c1", "r1", holder("r1"))
    with renewals.holding("t1", "r2", holder("r2")):
        await until(lambda: calls["r1"] and calls["r2"])
    assert calls["r1"][0] == ["c1", "c2"] and calls["r2"][0] == ["t1"]  # one call per holder
    renewals.release("c1")
    renewals.release("c2")
    task = renewals._task
    assert task is not None
    await asyncio.wait_for(task, 30)  # nothing held: the loop ends
    seen = {name: len(c) for name, c in calls.items()}
    await asyncio.sleep(0.05)
    assert {name: len(c) for name, c in calls.items()} == seen


async def test_a_stuck_holder_does_not_hold_up_the_others():
    stuck = asyncio.Event()  # never set: its renewal never answers
    stuck_calls: list[list[str]] = []
    live_calls: list[list[str]] = []

    async def renew_stuck(keys: list[str]) -> None:
        stuck_calls.append(keys)
        await stuck.wait()

    async def renew_live(keys: list[str]) -> None:
        live_calls.append(keys)

    renewals = LeaseRenewals(renew_s=0.01)
    with renewals.holding("a", "stuck", renew_stuck), renewals.holding("b", "live", renew_live):
        await until(lambda: len(live_calls) >= 5)
        assert stuck_calls == [["a"]]  # not called again while its renewal is in flight
    stuck.set()


async def test_a_failed_renewal_is_retried_next_period():
    attempts: list[list[str]] = []

    async def flaky(keys: list[str]) -> None:
        attempts.append(keys)
        if len(attempts) == 1:
            raise ConnectionError("the holder restarts")

    renewals = LeaseRenewals(renew_s=0.01)
    with renewals.holding("k", "holder", flaky):
        await until(lambda: len(attempts) >= 2)
    assert attempts[:2] == [["k"], ["k"]]


def test_a_renewal_left_pending_on_a_stopped_loop_does_not_block_the_next_loop():
    """A caller that runs its event loop in pieces (a trainer's `run_until_complete` per
    batch, each on a new loop): a renewal left unanswered on the old loop does not keep the
    new loop from renewing at that holder."""
    calls: list[list[str]] = []
    first_call = asyncio.Event()

    async def renew(keys: list[str]) -> None:
        calls.append(keys)
        if len(calls) == 1:
            first_call.set()
            await asyncio.Event().wait()  # unanswered when its loop stops

    renewals = LeaseRenewals(renew_s=0.01)

    async def hold_until(key: str, condition) -> None:
        renewals.hold(key, "holder", renew)
        await until(condition)

    for loop_calls in (lambda: first_call.is_set(), lambda: len(calls) >= 3):
        loop = asyncio.new_event_loop()
        try:  # not asyncio.run: the pending renewal is left as it is, not cancelled
            loop.run_until_complete(hold_until("k", loop_calls))
        finally:
            loop.close()
    assert calls[:3] == [["k"], ["k"], ["k"]]
