"""Schemathesis against the app's own OpenAPI schema, in process over ASGI, on a tiny model:
positive and negative generated requests for every operation, with the admin key (so admin
routes are reached too). No 5xx, and every error is an OpenAI error body."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from actors.engine import AsyncLLMEngine, LLMEngine
from session_server.app import build_app
from session_server.backend import LocalBackend
from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config

schemathesis = pytest.importorskip("schemathesis")

ADMIN_KEY = "fuzz-admin"
EXAMPLES = 100  # at most, per operation and mode (small input spaces run out sooner)


@pytest.fixture(scope="module")
def api_schema(tiny_llama_dir):
    engine = LLMEngine(tiny_config(tiny_llama_dir))
    app = build_app(LocalBackend(AsyncLLMEngine(engine), MODEL), admin_api_key=ADMIN_KEY,
                    max_body_bytes=MAX_BODY)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def test_no_5xx_and_openai_error_bodies(api_schema):
    from schemathesis.generation import GenerationMode

    calls, failures = [], []

    for mode, operation in [(m, op) for m in ("positive", "negative")
                            for op in operations(api_schema)]:
        @given(case=operation.as_strategy(GenerationMode(mode)))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            calls.append(response.status_code)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.text[:300]))
            elif response.status_code >= 400:
                error = response.json()["error"]
                if set(error) != {"message", "type", "param", "code"}:
                    failures.append((case.method, case.path, "bad error body", error))

        try:
            check()
        except Unsatisfiable:  # nothing to break (negative mode on a route with no input)
            pass
    print(f"\n{len(calls)} requests over {len(operations(api_schema))} operations")
    assert len(calls) >= 2000, len(calls)
    assert not failures, failures[:5]
