"""Shared pieces of the session-store tests: a durable store in a dict (the JSON a PostgreSQL
row holds), registries whose replies depend on the prompt alone, and sample comparison."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from raylane.actors.engine.outputs import CompletionOutput
from raylane.router.errors import SessionStoreUnavailable
from raylane.router.session_codec import decode_session, encode_session
from raylane.router.sessions import SessionConfig, SessionRegistry
from raylane.router.tito import TemplateSplicer

from tests.support.fake_generator import FakeTurnGenerator
from tests.unit.sessions_helpers import Agent, logprobs_for


class JsonStore:
    """A durable `SessionStore` in a dict, through the JSON `PgSessionStore` writes."""

    durable = True

    def __init__(self) -> None:
        self.rows: dict[str, str] = {}
        self.fail = False
        self.loads = 0

    def _check(self) -> None:
        if self.fail:
            raise SessionStoreUnavailable("the session store is down")

    async def save(self, session) -> None:
        self._check()
        self.rows[session.id] = json.dumps(encode_session(session), allow_nan=False)

    async def load(self, session_id: str):
        self._check()
        self.loads += 1
        await asyncio.sleep(0)  # a real store yields to the loop
        text = self.rows.get(session_id)
        return None if text is None else decode_session(json.loads(text))

    async def delete(self, session_ids: list[str]) -> None:
        self._check()
        for session_id in session_ids:
            self.rows.pop(session_id, None)

    async def purge(self, idle_before: float) -> int:
        self._check()
        old = [k for k, v in self.rows.items() if json.loads(v)["last_used"] < idle_before]
        for k in old:
            del self.rows[k]
        return len(old)

    async def close(self) -> None:
        pass

    def stored(self, session_id: str) -> dict:
        return json.loads(self.rows[session_id])


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def registry_over(tok, store, clock=None, model: str | None = None, **config) -> SessionRegistry:
    """Replies are a function of the prompt alone, so two registries generate alike; `model`:
    the served model the registry's sessions record."""

    def reply(prompt_ids: list[int]) -> CompletionOutput:
        text = f"reply {len(prompt_ids)}"
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return CompletionOutput(0, text, ids, logprobs_for(ids))

    return SessionRegistry(
        TemplateSplicer(tok),
        FakeTurnGenerator(reply, weight_version=3),
        SessionConfig(**config),
        clock=clock or Clock(),
        store=store,
        model=model,
    )


async def agent_over(registry: SessionRegistry) -> Agent:
    return await Agent.start(registry, {"run": 7})


def same_sample(a, b) -> None:
    assert a.to_json() == b.to_json()
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


TURNS = ["Weather in Berlin?", "And tomorrow?", "Thanks, bye."]
