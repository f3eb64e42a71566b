"""The adapter-only update over the trainer's collective group (gloo), through the admin routes of
the app `raylane serve` builds: a trainer process (tests/weight_trainer.py, rank 0) broadcasts
another PEFT adapter's tensors under PEFT's names; the served adapter's greedy output then equals
PEFT's with that adapter. A mismatched manifest is refused before a byte moves, and a trainer
that dies halfway rolls the update back: outputs and the adapter's version stay as they were."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend
from safetensors import safe_open

from tests.e2e.admin_helpers import ADMIN_KEY, USER_KEY, keyed_client
from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config
from tests.e2e.server import ServerThread
from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.weight_trainer import GROUP, Trainer

pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 1, 250, 64, 12]]
MAX_TOKENS = 8


def adapter_specs(adapter_dir: str) -> list[dict]:
    with safe_open(f"{adapter_dir}/adapter_model.safetensors", "pt") as f:
        return [
            {"name": n, "shape": list(f.get_slice(n).get_shape()), "dtype": "float32"}
            for n in f.keys()  # noqa: SIM118
        ]


def adapter_trainer(adapter_dir: str, specs: list[dict], tmp: Path, **plan) -> Trainer:
    """tests/weight_trainer.py's trainer (rank 0, one broadcast per tensor), sending the
    adapter's file under PEFT's names (it reads `model.safetensors` from the directory given)."""
    sender = tmp / f"sender-{len(list(tmp.iterdir()))}"
    sender.mkdir()
    (sender / "model.safetensors").symlink_to(Path(adapter_dir) / "adapter_model.safetensors")
    return Trainer(str(sender), specs, **plan)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_collective")
    return {
        "old": make_adapter(tiny_llama_dir, root / "old", seed=11, r=4),
        "new": make_adapter(tiny_llama_dir, root / "new", seed=12, r=4),
    }


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, adapters):
    return peft_models(tiny_llama_dir, adapters)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters) -> Iterator[ServerThread]:
    engine = LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8))
    backend = local_backend(AsyncLLMEngine(engine), MODEL)
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv, keyed_client(srv, ADMIN_KEY) as admin:
        body = {"lora_name": "policy", "lora_path": adapters["old"]}
        assert admin.post("/v1/load_lora_adapter", json=body).status_code == 200
        yield srv


def greedy(user: httpx.Client, prompt: list[int]) -> list[int]:
    sampling = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sampling, "lora_path": "policy"}
    resp = user.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def version(user: httpx.Client) -> int:
    cards = {c["id"]: c for c in user.get("/v1/models").json()["data"]}
    return cards["policy"]["lora_version"]


def joined(admin: httpx.Client, trainer: Trainer) -> None:
    resp = admin.post("/admin/update_lora/init_group", json={"init_info": trainer.info()})
    assert resp.status_code == 200, resp.text


def update(admin: httpx.Client, trainer: Trainer, specs: list[dict]) -> httpx.Response:
    """begin -> receive while the trainer broadcasts -> commit (the commit's answer)."""
    begin = admin.post("/admin/update_lora/begin", json={"lora_name": "policy", "tensors": specs})
    assert begin.status_code == 200, begin.text
    update_id = begin.json()["update_id"]
    trainer.send()
    got = admin.post(f"/admin/update_lora/{update_id}/receive", json={"group_name": GROUP})
    if got.status_code != 200:
        return got
    assert got.json()["tensors"] == len(specs)
    return admin.post(f"/admin/update_lora/{update_id}/commit", json={"version": "step-1"})


def test_update_over_gloo_serves_the_new_adapter(server, adapters, peft, tmp_path):
    specs = adapter_specs(adapters["new"])
    with keyed_client(server, ADMIN_KEY) as admin, keyed_client(server, USER_KEY) as user:
        assert greedy(user, PROMPTS[0]) == peft_greedy(peft, "old", PROMPTS[0], MAX_TOKENS)[0]
        before = version(user)
        trainer = adapter_trainer(adapters["new"], specs, tmp_path)
        try:
            joined(admin, trainer)
            resp = update(admin, trainer, specs)
            assert resp.status_code == 200, resp.text
        finally:
            trainer.close()
        assert version(user) == before + 1 == resp.json()["version"]
        for prompt in PROMPTS:
            assert greedy(user, prompt) == peft_greedy(peft, "new", prompt, MAX_TOKENS)[0]


def test_mismatch_and_broken_trainer_change_nothing(server, adapters, peft, tmp_path):
    specs = adapter_specs(adapters["old"])
    with keyed_client(server, ADMIN_KEY) as admin, keyed_client(server, USER_KEY) as user:
        before = [greedy(user, p) for p in PROMPTS]
        at = version(user)
        bad = [dict(specs[0], shape=[d + 1 for d in specs[0]["shape"]]), *specs[1:]]
        resp = admin.post("/admin/update_lora/begin", json={"lora_name": "policy", "tensors": bad})
        assert resp.status_code == 400, resp.text  # refused on every rank: nothing was sent
        trainer = adapter_trainer(adapters["old"], specs, tmp_path, stop_after=len(specs) // 2)
        try:
            joined(admin, trainer)
            resp = update(admin, trainer, specs)  # the trainer dies halfway
        finally:
            trainer.close()
        assert resp.status_code == 503 and "rolled back" in resp.json()["error"]["message"]
        assert version(user) == at
        assert [greedy(user, p) for p in PROMPTS] == before
