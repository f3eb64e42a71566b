"""`RolloutClient.sleep` / `wake_up` against the real app (tiny Llama, `local_backend`, the
trainer API and an admin key): the engine sleeps and wakes, a request sent while it sleeps
waits for the wake-up, and generation before and after equals the offline engine's; the
client's control plane verbs (`PlaneClient`, what the Ray transport runs) do the same."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from raylane.client import RolloutClient
from raylane.client.plane_client import PlaneClient
from raylane.session_server.app import build_app
from raylane.session_server.backend import Backend, local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread

USER_KEY = "sk-user"
ADMIN_KEY = "sk-admin"
PROMPT = [5, 17, 42, 99, 7, 150, 33]
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="module")
def local(engine) -> Backend:
    return local_backend(AsyncLLMEngine(engine), "tiny")


@pytest.fixture(scope="module")
def url(local) -> Iterator[str]:
    app = build_app(local, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, trainer_api=True)
    with ServerThread(app) as srv:
        yield srv.url


@pytest.fixture
async def client(url):
    async with RolloutClient(url, api_key=USER_KEY, admin_key=ADMIN_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def reference(ref_engine) -> tuple[list[int], list[float]]:
    """The offline engine's sample of PROMPT (a second engine on the same model)."""
    (out,) = ref_engine.generate([PROMPT], SamplingParams(**SAMPLED), use_tqdm=False)
    return list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)


async def assert_generates_the_reference(client: RolloutClient, reference) -> None:
    (rollout,) = await client.generate(PROMPT, **SAMPLED)
    assert list(rollout.token_ids) == reference[0]
    assert rollout.logprobs == pytest.approx(reference[1], abs=1e-4)


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_then_wake_up_generates_as_the_offline_engine(client, engine, reference, level):
    await assert_generates_the_reference(client, reference)
    await client.sleep(level)
    assert engine.upkeep.sleeping
    waiting = asyncio.create_task(client.generate(PROMPT, **SAMPLED))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # held while the engine sleeps
    await client.wake_up()
    assert not engine.upkeep.sleeping
    (held,) = await waiting
    assert list(held.token_ids) == reference[0]
    await assert_generates_the_reference(client, reference)


async def test_waking_only_the_weights_leaves_it_asleep(client, engine, reference):
    await client.sleep(2)
    await client.wake_up(["weights"])
    assert engine.upkeep.sleeping  # no KV cache yet: it stays paused
    await client.wake_up(["kv_cache"])
    assert not engine.upkeep.sleeping
    await assert_generates_the_reference(client, reference)


async def test_bad_levels_and_tags_are_refused_and_change_nothing(client, engine, reference):
    with pytest.raises(ValueError, match="level"):
        await client.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        await client.wake_up(["everything"])
    assert not engine.upkeep.sleeping
    await assert_generates_the_reference(client, reference)


async def test_the_control_plane_verbs_sleep_and_wake_the_engine(client, local, engine, reference):
    plane = PlaneClient(local.control)  # what RayTransport runs on the Router's plane
    await plane.sleep(1)
    assert engine.upkeep.sleeping
    await plane.wake_up(None)
    assert not engine.upkeep.sleeping
    await assert_generates_the_reference(client, reference)
