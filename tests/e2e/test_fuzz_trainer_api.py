"""Schemathesis over the trainer API's own operations (build_app(trainer_api=True), with the
admin key), in process on a tiny model, as tests/e2e/test_fuzz_schema.py does for the rest: no
5xx, every error the OpenAI error body, every response as its schema declares. Routes that pause
or put the engine to sleep are undone after each call, so generation is never left waiting."""

from __future__ import annotations

import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend
from raylane.session_server.trainer_api import MODULES

from tests.e2e.conftest import MAX_BODY, MODEL
from tests.e2e.test_fuzz_schema import AUTH, TIMEOUT_S, fuzz

schemathesis = pytest.importorskip("schemathesis")
EXAMPLES = 8  # per operation and mode: the trainer routes are many and mostly small
# generation routes: fewer, on a short context (tests/e2e/test_fuzz_schema.py fuzzes /generate)
GENERATING = {"/generate", "/inference/v1/generate", "/generate/", "/chat/"}
PAUSING = {"/pause", "/pause_generation", "/sleep"}
# routes that may open a weight update (pausing in mode "keep"): committed after each call
UPDATING = {
    "/start_weight_update",
    "/collective_rpc",
    "/update_named_param/",
    "/batch_update_named_params/",
}
# the collective weight-transfer routes of every protocol (a trainer's broadcast makes them
# succeed: tests/unit/test_collective_weights.py, tests/e2e/test_trl_communicator.py and
# tests/e2e/test_skyrl_client.py check those answers against the schema too)
COLLECTIVE = {
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/init_communicator/",
    "/update_named_param/",
    "/batch_update_named_params/",
    "/close_communicator/",
    "/collective_rpc",
}


@pytest.fixture(scope="module")
def app(tiny_llama_dir):
    # a 48-token context bounds every generated request
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=32, max_model_len=48))
    backend = local_backend(AsyncLLMEngine(engine), MODEL)
    return build_app(
        backend, admin_api_key="fuzz-admin", max_body_bytes=MAX_BODY, max_n=2, trainer_api=True
    )


def trainer_operations(app) -> list:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    paths = {r.path for m in MODULES for r in [*m.router.routes, *m.control.routes]}
    paths.add("/generate")  # SGLang's types while the trainer API is on
    return [op.ok() for op in schema.get_all_operations() if op.ok().path in paths]


def test_trainer_routes_fuzz_clean(app):
    from starlette.testclient import TestClient

    undo = TestClient(app, headers=AUTH)
    operations = trainer_operations(app)
    assert COLLECTIVE <= {op.path for op in operations}

    def call(case):
        response = case.call(headers=AUTH, timeout=TIMEOUT_S)
        if case.path in UPDATING:
            undo.post("/finish_weight_update")
        if case.path in PAUSING | UPDATING:
            undo.post("/wake_up")
            undo.post("/resume")
        return response

    calls, failures = fuzz(operations, lambda op: 4 if op.path in GENERATING else EXAMPLES, call)
    print(f"\n{len(calls)} requests over {len(operations)} trainer operations")
    assert len(operations) >= 30 and len(calls) >= 200, (len(operations), len(calls))
    assert not failures, failures[:5]
