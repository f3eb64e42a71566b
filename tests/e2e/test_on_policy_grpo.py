"""The on-policy GRPO example, one step, against a real HTTP server whose engine runs in the
batch-invariant mode: the trainer's teacher-forced logprobs equal the rollouts' bit for bit
(gap exactly 0) before and after a weight update, and transformers' own kernels do not."""

from __future__ import annotations

import asyncio

import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.examples import on_policy_grpo
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.admin_helpers import ADMIN_KEY, USER_KEY
from tests.e2e.conftest import MAX_BODY, tiny_config
from tests.e2e.server import ServerThread


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    engine = LLMEngine(tiny_config(tiny_llama_dir, dtype="bfloat16", batch_invariant=True))
    backend = local_backend(AsyncLLMEngine(engine), "tiny")
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv.url
    engine.shutdown()


def test_two_steps_are_bitwise_on_policy_across_a_weight_update(url, tiny_llama_dir):
    args = on_policy_grpo.parse_args(
        ["--url", url, "--api-key", USER_KEY, "--admin-key", ADMIN_KEY, "--model", tiny_llama_dir]
        + ["--steps", "2", "--group", "3", "--max-tokens", "10", "--lr", "1e-2"]
    )
    reports = asyncio.run(on_policy_grpo.run(args))
    assert [r.version for r in reports] == [1, 2]  # weights were pushed after each step
    for r in reports:
        assert r.gap_on == 0.0  # the importance ratio is exactly 1 for every token
        assert r.gap_off > 0.0  # outside the context the kernels differ
