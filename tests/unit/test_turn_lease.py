"""A session turn's lease at the Router. The ingress generating a turn renews it while it lives;
one that died mid-turn stops (Ray does not end the Router's call of a dead caller), and the
Router drops the turn once the lease lapses, so the session serves its next turn instead of
staying locked for as long as any turn could take. Over the plain `Router` class and the
ingress's `RouterSessions` (tests/unit/router_ingress.py).

Reference: the fake generator's replies ("reply N" + eos, N counting its calls)."""

from __future__ import annotations

import asyncio

import pytest
from raylane.router.actor import Router
from raylane.router.errors import ReplicaFailed
from raylane.router.session_host import SessionSetup
from raylane.router.turn_handoff import RENEW_S, TurnHandoff, TurnTicket
from raylane.serve_backend import RouterSessions

from tests.tiny_models import make_tokenizer
from tests.unit.router_ingress import InProcessRouter
from tests.unit.sessions_helpers import make_registry, user

SETUP = SessionSetup("tiny")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def make_router(tok, lease_s: float) -> Router:
    router = Router(capacity=2)
    router.sessions.load_tokenizer = lambda _: tok
    router.sessions.handoff.lease_s = lease_s
    return router


async def turn(sessions: RouterSessions, session_id: str, text: str) -> list:
    return [r async for r in sessions.chat_stream(session_id, [user(text)], None)]


def first_reply(tok) -> list[int]:
    return tok.encode("reply 0", add_special_tokens=False) + [tok.eos_token_id]


def test_a_dead_ingress_costs_a_few_renewals_not_a_turn():
    # what a dead ingress holds a session for by default: a few of its renewal periods
    assert TurnHandoff().lease_s <= 5 * RENEW_S <= 30


async def test_a_turn_whose_ingress_died_frees_the_session_when_its_lease_lapses(tok):
    router = make_router(tok, lease_s=0.3)
    session_id = await router.session_create(SETUP)
    # the dead ingress took the turn's ticket, then neither renewed it nor handed it back
    orphan = router.session_turn(SETUP, session_id, [user("hello")], None)
    assert isinstance(await anext(orphan), TurnTicket)
    # a live ingress's turn on the same session waits for it, then is served
    sessions = RouterSessions(InProcessRouter(router), SETUP, make_registry(tok)[1])
    results = await asyncio.wait_for(turn(sessions, session_id, "hello"), 60)
    assert results[-1].message is not None
    assert results[-1].output.token_ids == first_reply(tok)
    with pytest.raises(ReplicaFailed):  # the orphan's call ends with the dropped turn
        await anext(orphan)
    (record,) = (await router.session_describe(SETUP, session_id))["records"]
    assert record["output_ids"] == first_reply(tok)  # the orphan left no trace


async def test_a_live_ingress_keeps_a_turn_that_outlasts_the_lease(tok):
    router = make_router(tok, lease_s=1.0)
    gate = asyncio.Event()  # the generation waits on it: a turn longer than the lease
    sessions = RouterSessions(InProcessRouter(router), SETUP, make_registry(tok, gate=gate)[1])
    sessions.leases.renew_s = 0.05
    session_id = await router.session_create(SETUP)
    running = asyncio.ensure_future(turn(sessions, session_id, "hello"))
    await asyncio.sleep(2.5)
    assert not running.done()
    gate.set()
    results = await asyncio.wait_for(running, 60)
    assert results[-1].message is not None
    assert results[-1].output.token_ids == first_reply(tok)
    (record,) = (await router.session_describe(SETUP, session_id))["records"]
    assert record["output_ids"] == first_reply(tok)
