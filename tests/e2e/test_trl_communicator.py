"""TRL's former weight sync (`/init_communicator/`, `/update_named_param/` per tensor,
`/reset_prefix_cache/`, `/close_communicator/`) over HTTP from a trainer process that follows
TRL's client call for call (tests/trl_weight_trainer.py; gloo in place of vLLM's NCCL helper,
which needs CUDA). The server has its own engine, since the test moves its weights.

Checks: the greedy output then equals HF's on the new weights, at version 1; a tensor
announced with a wrong shape is a 400 and leaves the weights and version as they were, the
tensors sent before it included; the forks' `/batch_update_named_params/` (several tensors
announced per call) brings the next weights the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.hf_reference import hf_greedy, hf_model, perturbed_model
from tests.schema_checks import answer_problems, recorded
from tests.weight_trainer import free_port

PROMPTS = [[(5 * i + 3 * j) % 200 + 7 for j in range(10 + 6 * i)] for i in range(2)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(LLMEngine(tiny_config(tiny_llama_dir))), "tiny")
    with ServerThread(build_app(backend, trainer_api=True)) as srv:
        yield srv


def greedy(http: httpx.Client) -> list[list[int]]:
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    answers = [
        http.post("/inference/v1/generate", json={"token_ids": p, "sampling_params": sampling})
        for p in PROMPTS
    ]
    return [a.json()["choices"][0]["token_ids"] for a in answers]


def trl_trainer(
    server: ServerThread, model_dir: str, bad: dict | None = None, batch: int | None = None
) -> list[list]:
    """Run the TRL-shaped trainer to its end; [path, status] of each of its calls, whose
    answers must be as the schema declares them."""
    names = [name for name, _ in hf_model(model_dir).named_parameters()]  # TRL's order
    plan = {"url": server.url, "port": free_port(), "file": f"{model_dir}/model.safetensors"}
    plan.update(names=names, bad=bad or {}, batch=batch)
    done = subprocess.run(
        [sys.executable, "-m", "tests.trl_weight_trainer", json.dumps(plan)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer_problems(server.app, [recorded(*a) for a in answers]) == []
    return [[path, status] for _, path, status, _ in answers[1:]]  # after /get_world_size/


def test_trl_weight_sync_is_one_transaction(server, tiny_llama_dir, tmp_path):
    v1_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v1"), 11)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = greedy(http)
        assert before == [hf_greedy(tiny_llama_dir, p, 6)[0] for p in PROMPTS]

        names = [name for name, _ in hf_model(v1_dir).named_parameters()]
        victim = next(n for n in names[2:] if "k_proj" in n)  # after some were sent
        codes = trl_trainer(server, v1_dir, bad={victim: [3, 3]})
        assert codes[-2:] == [["/update_named_param/", 400], ["/close_communicator/", 200]]
        assert len(codes) > 4  # tensors before it were broadcast and loaded, then dropped
        assert greedy(http) == before
        assert http.get("/weight_info").json()["weight_version"] == "0"
        assert http.get("/is_paused").json() == {"is_paused": False}

        codes = trl_trainer(server, v1_dir)
        assert {code for _, code in codes} == {200}
        assert [path for path, _ in codes[-2:]] == ["/reset_prefix_cache/", "/close_communicator/"]
        assert http.get("/weight_info").json()["weight_version"] == "1"
        assert greedy(http) == [hf_greedy(v1_dir, p, 6)[0] for p in PROMPTS]

        v2_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v2"), 12)
        codes = trl_trainer(server, v2_dir, batch=7)  # the forks' batched announcements
        assert {code for _, code in codes} == {200} and len(codes) > 4
        assert codes[1][0] == "/batch_update_named_params/"
        assert http.get("/weight_info").json()["weight_version"] == "2"
        assert greedy(http) == [hf_greedy(v2_dir, p, 6)[0] for p in PROMPTS]
