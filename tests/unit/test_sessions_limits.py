"""Session TTL and the cap on live sessions: idle sessions expire, the least recently used one
makes room, sessions in a turn are never dropped, and a dropped id answers 404 saying why."""

from __future__ import annotations

import asyncio

import pytest
from raylane.router.errors import SessionNotFound, TooManySessions
from raylane.router.sessions import SessionConfig

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import make_registry, user


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry_with(tok, clock: Clock, gate: asyncio.Event | None = None, **config):
    registry, gen = make_registry(tok, SessionConfig(**config), gate=gate)
    registry.clock = clock
    return registry, gen


async def test_idle_sessions_expire_and_say_so(tok):
    clock = Clock()
    registry, _ = registry_with(tok, clock, ttl_s=60)
    old, used = await registry.create(), await registry.create()
    clock.now += 40
    await registry.chat(used, [user("hi")])  # used at 1040 (the TTL counts from its end)
    clock.now += 30  # old idle 70 s, used idle 30 s
    assert len((await registry.get(used)).trajectory) == 1
    with pytest.raises(SessionNotFound, match="expired.*unused for over 60 s") as err:
        await registry.get(old)
    assert err.value.status == 404
    with pytest.raises(SessionNotFound, match="never created"):
        await registry.get("sess-unknown")


async def test_the_least_recently_used_session_makes_room(tok):
    clock = Clock()
    registry, _ = registry_with(tok, clock, max_sessions=2, ttl_s=None)
    a = await registry.create()
    b = await registry.create()
    clock.now += 1
    await registry.get(a)  # a is now the most recently used
    c = await registry.create()
    assert a in registry and c in registry and b not in registry and len(registry) == 2
    with pytest.raises(SessionNotFound, match="least recently used of 2"):
        await registry.chat(b, [user("hi")])


async def test_sessions_in_a_turn_are_never_dropped(tok):
    clock = Clock()
    gate = asyncio.Event()
    registry, _ = registry_with(tok, clock, gate=gate, max_sessions=1, ttl_s=10)
    busy = await registry.create()
    turn = asyncio.create_task(registry.chat(busy, [user("hi")]))
    for _ in range(20):
        await asyncio.sleep(0)
    clock.now += 100  # past the TTL, but in a turn
    with pytest.raises(TooManySessions) as err:
        await registry.create()
    assert err.value.status == 429 and busy in registry
    gate.set()
    await turn
    assert len((await registry.get(busy)).trajectory) == 1


def test_bad_limits_are_value_errors():
    for bad in ({"ttl_s": 0}, {"max_sessions": 0}, {"max_sessions": 1.5}):
        with pytest.raises(ValueError):
            SessionConfig(**bad)
