"""A stored session records the model that made it: loaded for another model (the app was
redeployed) it is a 409 naming both, never continued with the wrong chat template; rows stored
before the model was recorded still load. In-memory store (the JSON a PostgreSQL row holds),
and the HTTP error body."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import httpx
import pytest
from raylane.router.errors import SessionModelMismatch
from raylane.session_server.app import build_app
from raylane.session_server.backend import ModelInfo

from tests.tiny_models import make_tokenizer
from tests.unit.session_store_helpers import TURNS, JsonStore, agent_over, registry_over


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def test_a_session_records_its_model_and_another_model_is_refused(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store, model="/models/a"))
    await agent.user(TURNS[0])
    assert store.stored(agent.id)["model"] == "/models/a"
    assert (await agent.registry.describe(agent.id))["model"] == "/models/a"

    other = registry_over(tok, store, model="/models/b")  # redeployed with another model
    calls = [
        other.describe(agent.id),
        other.sample(agent.id),
        other.delete(agent.id),
        other.chat(agent.id, agent.messages + [{"role": "user", "content": TURNS[1]}]),
    ]
    for call in calls:
        with pytest.raises(SessionModelMismatch) as err:
            await call
        assert err.value.status == 409 and err.value.code == "session_model_mismatch"
        assert "'/models/a'" in str(err.value) and "'/models/b'" in str(err.value)
    assert len(other) == 0 and agent.id in store.rows  # neither served nor deleted

    agent.registry = registry_over(tok, store, model="/models/a")  # the same model carries on
    await agent.user(TURNS[1])
    assert (await agent.registry.describe(agent.id))["num_turns"] == 2


async def test_a_row_stored_before_models_were_recorded_loads_and_records_it(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store, model=None))  # no model: nothing recorded
    await agent.user(TURNS[0])
    row = store.stored(agent.id)
    del row["model"]  # as a Router before this change wrote it
    store.rows[agent.id] = json.dumps(row)

    agent.registry = registry_over(tok, store, model="/models/a")
    assert (await agent.registry.describe(agent.id))["num_turns"] == 1
    await agent.user(TURNS[1])
    assert store.stored(agent.id)["model"] == "/models/a"  # from now on it is checked
    with pytest.raises(SessionModelMismatch):
        await registry_over(tok, store, model="/models/b").describe(agent.id)


async def test_a_registry_that_does_not_know_its_model_checks_nothing(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store, model="/models/a"))
    await agent.user(TURNS[0])
    described = await registry_over(tok, store, model=None).describe(agent.id)
    assert described["model"] == "/models/a" and described["num_turns"] == 1


def test_the_error_survives_pickling():
    error = SessionModelMismatch("sess-x", "/models/a", "/models/b")
    copy = pickle.loads(pickle.dumps(error))  # Ray ships it from the Router to the ingress
    assert type(copy) is SessionModelMismatch and str(copy) == str(error)
    assert (copy.recorded, copy.served, copy.status) == ("/models/a", "/models/b", 409)


async def test_http_answers_409_with_the_openai_error_body(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store, model="/models/a"))
    await agent.user(TURNS[0])
    backend = SimpleNamespace(
        info=ModelInfo("tiny", 512, len(tok)),
        tokenizer=tok,
        control=None,
        sessions=registry_over(tok, store, model="/models/b"),
    )
    transport = httpx.ASGITransport(app=build_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        responses = [
            await http.get(f"/sessions/{agent.id}"),
            await http.post(
                f"/sessions/{agent.id}/v1/chat/completions",
                json={"messages": agent.messages, "max_tokens": 4},
            ),
        ]
    for response in responses:
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["code"] == "session_model_mismatch"
        assert error["type"] == "invalid_request_error"
        assert "'/models/a'" in error["message"] and "'/models/b'" in error["message"]
