"""The verl adapter (`raylane.integrations.verl`) against verl's contract: the server's
`generate(prompt_ids, sampling_params, request_id)` gives Hugging Face's greedy tokens and
logprobs with verl's stop reasons, and abort / sleep / wake_up reach the engine. verl itself
does not install beside raylane on the CPU (it pins another transformers), so its registry is
the documented one (`RolloutReplicaRegistry.register(name, loader)`, `RolloutReplica`,
`TokenOutput`), stood in by a module with those names."""

from __future__ import annotations

import asyncio
import sys
import types
from abc import ABC

import pytest
from pydantic import BaseModel
from raylane.client import RolloutClient
from raylane.integrations import verl

from tests.e2e.test_admin import PROMPT
from tests.hf_reference import hf_greedy


@pytest.fixture
async def server(trainer_server, trainer_backend, trainer):
    client = RolloutClient(trainer_server.url)
    yield verl.RaylaneRolloutServer(client, trainer_backend.control, max_tokens=6)
    await client.close()


async def test_generate_is_hf_greedy_with_verl_fields(server, tiny_llama_dir):
    sampling = {"temperature": 0.0, "logprobs": True, "ignore_eos": True}
    out = await server.generate(PROMPT, sampling, "verl-1")
    ids, logprobs = hf_greedy(tiny_llama_dir, PROMPT, 6)
    assert isinstance(out, verl.TokenOutput) and out.token_ids == ids
    assert out.log_probs == pytest.approx(logprobs, abs=1e-4)
    assert out.stop_reason == "completed" and out.routed_experts is None
    plain = await server.generate(PROMPT, {"temperature": 0.0, "max_tokens": 2}, "verl-2")
    assert plain.log_probs is None and plain.token_ids == ids[:2]
    with pytest.raises(ValueError, match="bogus"):
        await server.generate(PROMPT, {"bogus": 1}, "verl-3")


async def test_abort_sleep_and_wake_up(server, trainer_engine):
    sampling = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}
    running = asyncio.create_task(server.generate(PROMPT, sampling, "verl-long"))
    while not trainer_engine.has_unfinished_requests():
        await asyncio.sleep(0.01)
    await server.abort_request("verl-long")
    out = await running
    assert out.stop_reason == "aborted" and len(out.token_ids) < 200
    await server.sleep()
    assert trainer_engine.upkeep.sleeping
    await server.wake_up()
    assert not trainer_engine.upkeep.sleeping
    await server.clear_kv_cache()
    assert (await server.generate(PROMPT, {"max_tokens": 3}, "verl-4")).token_ids


def test_registers_with_verls_registry(monkeypatch):
    module = types.ModuleType("verl.workers.rollout.replica")

    class Registry:
        _registry: dict = {}

        @classmethod
        def register(cls, name, loader):
            cls._registry[name] = loader

        @classmethod
        def get(cls, name):
            return cls._registry[name]()

    class TokenOutput(BaseModel):
        token_ids: list[int]
        log_probs: list[float] | None = None
        routed_experts: object = None
        stop_reason: str | None = None
        num_preempted: int | None = None

    module.RolloutReplicaRegistry = Registry  # type: ignore[attr-defined]
    module.RolloutReplica = type("RolloutReplica", (ABC,), {})  # type: ignore[attr-defined]
    module.TokenOutput = TokenOutput  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.replica", module)
    assert verl.register() is True
    replica = Registry.get("raylane")
    assert issubclass(replica, module.RolloutReplica) and replica.__name__ == "RaylaneReplica"
    assert isinstance(verl.token_output(token_ids=[1], stop_reason="completed"), TokenOutput)
