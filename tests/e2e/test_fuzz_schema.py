"""Schemathesis against the app's own OpenAPI schema, in process over ASGI, on a tiny model:
positive and negative generated requests for every operation, with the admin key (so admin
routes are reached too). No 5xx, every error is an OpenAI error body, and every response
conforms to the schema: its status and media type are documented and its JSON body validates
against the schema declared for that operation and status. Routes whose successes need ids the
fuzzer cannot guess (a live session, an open weight update) get one scripted pass each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.actors.models.weights import encode_bucket, specs_of
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend
from safetensors.torch import load_file

from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

ADMIN_KEY = "fuzz-admin"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
EXAMPLES = 100  # at most, per operation and mode (small input spaces run out sooner)
# seconds per request (schemathesis waits 10): a generation that fills the context can take
# longer on a shared 2-core machine, and a timeout there is load, not a finding
TIMEOUT_S = 60
# a generated body without max_tokens decodes until the context is full: nearly all of the run
# went to a dozen such answers. A shorter context halves each (the routes, fields and statuses
# reached are the same; a prompt past it gets the documented 400, as one past 256 did)
CONTEXT = 128
# the same inputs every run, so the suite is reproducible; RAYLANE_FUZZ_EXPLORE=1 draws new ones
# (worth a run now and then: each failure is a real bug, printed with a curl that reproduces it)
DERANDOMIZE = not os.environ.get("RAYLANE_FUZZ_EXPLORE")
DOCUMENTED = [status_code_conformance, content_type_conformance]
CONFORMANCE = [*DOCUMENTED, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(tiny_llama_dir):
    engine = LLMEngine(tiny_config(tiny_llama_dir, max_model_len=CONTEXT))
    # max_n: generated bodies ask for up to 128 samples of a full context each, minutes of
    # decoding on 2 cores; past 4 they get the 400 instead, so the run stays short
    app = build_app(
        local_backend(AsyncLLMEngine(engine), MODEL),
        admin_api_key=ADMIN_KEY,
        max_body_bytes=MAX_BODY,
        max_n=4,
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def findings(case, response) -> list[tuple]:
    """What is wrong with `response`: a 5xx, a 4xx without an OpenAI error body, or a
    disagreement with the schema (`nonconformance`)."""
    found: list[tuple] = []
    if response.status_code >= 500:
        found.append((case.method, case.path, case.body, response.text[:300]))
    elif response.status_code >= 400:
        error = response.json()["error"]
        if set(error) != {"message", "type", "param", "code"}:
            found.append((case.method, case.path, "bad error body", error))
    for problem in nonconformance(case, response):
        found.append((case.method, case.path, response.status_code, problem))
    return found


def nonconformance(case, response) -> list[str]:
    """How `response` disagrees with the schema `case`'s operation declares: an undocumented
    status or media type, or a body that does not validate."""
    checks = CONFORMANCE
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        # NOTE: a stream is SSE `data:` lines, not one JSON document, so only its status and
        # media type are checked here; its chunks are checked by tests/e2e/test_openai_api.py
        checks = DOCUMENTED
    try:
        case.validate_response(response, checks=checks)
    except FailureGroup as group:
        # the first paragraph says what is wrong and where; the rest dumps the whole schema
        return [f"{f.title}: {f.message.split(chr(10) * 2)[0]}" for f in group.exceptions]
    return []


def fuzz(operations: list, max_examples, call) -> tuple[list[int], list[tuple]]:
    """Positive, then negative generated cases of every operation, each sent by
    `call(case) -> response`: (the status codes, the `findings`). `max_examples(operation)`
    bounds the cases per operation and mode."""
    from schemathesis.generation import GenerationMode

    calls, failures = [], []
    for mode, operation in [(m, op) for m in ("positive", "negative") for op in operations]:

        @given(case=operation.as_strategy(GenerationMode(mode)))
        @settings(
            max_examples=max_examples(operation),
            deadline=None,
            database=None,
            derandomize=DERANDOMIZE,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = call(case)
            calls.append(response.status_code)
            failures.extend(findings(case, response))

        try:
            check()
        except Unsatisfiable:  # nothing to break (negative mode on a route with no input)
            pass
    return calls, failures


def test_no_5xx_openai_error_bodies_and_every_response_conforms(api_schema):
    calls, failures = fuzz(
        operations(api_schema),
        lambda operation: EXAMPLES,
        lambda case: case.call(headers=AUTH, timeout=TIMEOUT_S),
    )
    print(f"\n{len(calls)} requests over {len(operations(api_schema))} operations")
    assert len(calls) >= 2000, len(calls)
    assert not failures, failures[:5]


class Script:
    """Scripted calls through the schema's operations, each answer checked against it."""

    def __init__(self, api_schema):
        self.api_schema = api_schema
        self.failures: list[tuple] = []

    def call(self, method: str, path: str, headers: dict | None = None, **parts):
        case = self.api_schema[path][method].Case(**parts)
        response = case.call(headers={**AUTH, **(headers or {})}, timeout=TIMEOUT_S)
        assert response.status_code == 200, (method, path, response.text[:300])
        self.failures += [(method, path, problem) for problem in nonconformance(case, response)]
        return response


def test_session_lifecycle_conforms(api_schema):
    script = Script(api_schema)
    script.call("POST", "/admin/resume")  # the fuzzer may have left the engines paused
    sid = script.call("POST", "/sessions", body={"metadata": {"task": 1}}).json()["session_id"]
    at = {"session_id": sid}
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
    script.call("POST", "/sessions/{session_id}/v1/chat/completions", path_parameters=at, body=turn)
    script.call("GET", "/sessions/{session_id}", path_parameters=at)
    script.call("POST", "/sessions/{session_id}/samples", path_parameters=at, body={})
    script.call(
        "POST",
        "/sessions/{session_id}/samples",
        path_parameters=at,
        headers={"Accept": "application/safetensors"},
    )
    script.call("DELETE", "/sessions/{session_id}", path_parameters=at)
    assert not script.failures, script.failures


def test_admin_transactions_conform(api_schema, tiny_llama_dir):
    script = Script(api_schema)
    script.call("POST", "/admin/pause", body={"mode": "keep"})
    script.call("POST", "/admin/resume")
    named = [
        (name, t)
        for name, t in load_file(str(Path(tiny_llama_dir) / "model.safetensors")).items()
        if name == "model.norm.weight"
    ]  # the same values, a new version
    version = script.call("GET", "/admin/weight_version").json()["weight_version"] + 1
    update_id = script.call(
        "POST",
        "/admin/update_weights/begin",
        body={"version": version, "tensors": [s.to_dict() for s in specs_of(named)]},
    ).json()["update_id"]
    at = {"update_id": update_id}
    script.call(
        "POST",
        "/admin/update_weights/{update_id}/bucket",
        path_parameters=at,
        body=encode_bucket(named),
        media_type="application/octet-stream",
    )
    script.call("POST", "/admin/update_weights/{update_id}/commit", path_parameters=at)
    script.call("POST", "/admin/abort", body={"request_ids": ["none-running"]})
    script.call("POST", "/admin/flush_cache")
    assert not script.failures, script.failures
