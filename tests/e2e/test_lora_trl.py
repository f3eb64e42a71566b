"""TRL's AsyncGRPO adapter sync (trl 1.16, `trl.experimental.async_grpo`: trl#7017) against the
trainer API with LoRA on, with TRL's own pieces: `select_adapter_sync` decides from
`/server_info` to push the adapter only; each sync saves the trained adapter
(`save_lora_adapter`), pauses, loads it as `trl-policy-v{N}` (`VLLMClient.load_lora_adapter`),
resumes and unloads the version that fell out of the staleness window; the rollout worker asks
`/v1/completions` for `model: trl-policy-v{N}` as `_generate_one_turn` does. Greedy tokens equal
the trainer's own PeftModel at each version. (The trainer's GRPO loop itself needs a dataset and
accelerate's launch; its adapter-sync calls are these.)"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import torch
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.lora_adapters import ALL, peft_greedy

pytest.importorskip("peft")
async_grpo = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
vllm_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")

PROMPTS = [[5, 17, 42, 99, 7, 150], [3, 8, 1, 250, 64]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ServerThread]:
    engine = LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=3, max_lora_rank=8))
    backend = local_backend(AsyncLLMEngine(engine), "tiny")
    with ServerThread(build_app(backend, trainer_api=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    """The trainer's PEFT model (random B, as after some training)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(41)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
    return get_peft_model(base, config).eval()


def train_step(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)


def rollout(url: str, model: str, prompt: list[int]) -> list[int]:
    """The rollout worker's request (`_generate_one_turn`), greedy."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def test_async_grpo_adapter_sync(server, policy, tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # TRL's logging needs accelerate's state first
    client = vllm_client.VLLMClient(server.url)
    client.wait_for_server_ready()
    args = SimpleNamespace(max_staleness=1)  # the one AsyncGRPOConfig field it reads
    assert async_grpo.select_adapter_sync(client.get_server_info(), policy, args) is True
    for version in (1, 2, 3):
        train_step(policy)
        adapter_dir = str(tmp_path / f"trl-policy-v{version}")
        async_grpo.save_lora_adapter(policy, accelerator, "default", adapter_dir)
        client.pause()
        client.load_lora_adapter(f"trl-policy-v{version}", adapter_dir)
        client.resume()
        stale = version - (args.max_staleness + 1)
        if stale > 0:
            client.unload_lora_adapter(f"trl-policy-v{stale}")
        for prompt in PROMPTS:
            want = peft_greedy(policy, "default", prompt, MAX_TOKENS)[0]
            assert rollout(server.url, f"trl-policy-v{version}", prompt) == want
    served = {c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert served == {"tiny", "trl-policy-v2", "trl-policy-v3"}
