"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0; see tests/e2e/test_skyrl_client.py for how
it is imported) serving LoRA tenants the way SkyRL does against vLLM: each tenant's adapter
loaded with `load_lora_adapter` (SkyRL's `/skyrl/v1/load_lora_adapter`), reloaded in place
from a new directory as the trainer's next step, addressed per request by `model`, and
unloaded (`/v1/unload_lora_adapter`). Reference: PEFT's `PeftModel` for each tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.e2e.test_skyrl_client import client_class
from tests.lora_adapters import make_adapter, peft_greedy, peft_models

pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 99, 7, 150], [3, 8, 1, 250, 64]]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_skyrl")
    return {
        name: make_adapter(tiny_llama_dir, root / name, seed=seed, r=4)
        for name, seed in (("a", 31), ("b", 32), ("a-step-2", 33))
    }


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, adapters):
    return peft_models(tiny_llama_dir, adapters)


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ServerThread]:
    engine = LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8))
    backend = local_backend(AsyncLLMEngine(engine), "tiny")
    with ServerThread(build_app(backend, trainer_api=True)) as srv:
        yield srv


def test_tenants_by_model(server, adapters, peft):
    cls = client_class()

    async def generate(client, model: str) -> list[list[int]]:
        batch = {"prompt_token_ids": PROMPTS, "sampling_params": GREEDY}
        return (await client.generate(batch, model=model))["response_ids"]

    async def go():
        client = cls(
            proxy_url=server.url,
            server_urls=[server.url],
            data_parallel_size=1,
            model_name="tiny",
            uses_lora_weight_sync=True,
        )
        try:
            await client.load_lora_adapter("tenant-a", adapters["a"])
            await client.load_lora_adapter("tenant-b", adapters["b"])
            first = await asyncio.gather(*(generate(client, m) for m in ("tenant-a", "tenant-b")))
            base = await generate(client, "tiny")
            await client.load_lora_adapter("tenant-a", adapters["a-step-2"])  # in place
            second = await generate(client, "tenant-a")
            await client.unload_lora_adapter("tenant-b")
            with pytest.raises(Exception, match="404|does not exist"):
                await generate(client, "tenant-b")
            return first, base, second
        finally:
            await client.teardown()

    (on_a, on_b), base, on_a2 = asyncio.run(go())
    for adapter, got in (("a", on_a), ("b", on_b), (None, base), ("a-step-2", on_a2)):
        assert got == [peft_greedy(peft, adapter, p, 6)[0] for p in PROMPTS], adapter
