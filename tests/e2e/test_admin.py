"""The admin routes (RL control plane) over HTTP on the real engine: admin auth, pause modes,
weight updates in safetensors buckets, aborts, and the weight version in every answer.

References: Hugging Face `generate` on the weights each update sends (v0: the checkpoint, v1:
seeded noise on it, saved as its own model). The server here has its own engine, so updates do
not reach the other e2e tests; each test first loads the weights it needs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.actors.models.weights import encode_bucket, iter_buckets, specs_of
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config
from tests.e2e.server import ServerThread
from tests.hf_reference import hf_greedy, hf_model, perturbed_model

ADMIN_KEY = "admin-secret"
USER_KEY = "user-key"
PROMPT = [5, 17, 42, 99, 7, 150, 33]
LONG = 200  # tokens: long enough to act on a request while it runs


@pytest.fixture(scope="module")
def admin_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="module")
def admin_server(admin_engine) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(admin_engine), MODEL)
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv


def _client(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, timeout=60, headers=headers)


@pytest.fixture
def user(admin_server) -> Iterator[httpx.Client]:
    with _client(admin_server, USER_KEY) as client:
        yield client


@pytest.fixture
def admin(admin_server) -> Iterator[httpx.Client]:
    with _client(admin_server, ADMIN_KEY) as client:
        yield client
        client.post("/admin/resume")  # whatever a test left paused


@pytest.fixture(scope="module")
def weights(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[str, list]]:
    """{"v0": the checkpoint, "v1": v0 plus seeded noise}: (model dir, named HF tensors)."""
    v0 = [(n, p.detach().clone()) for n, p in hf_model(tiny_llama_dir).named_parameters()]
    v1 = perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_llama_admin_v1")), 23)
    return {"v0": (tiny_llama_dir, v0), "v1": v1}


def version_of(admin: httpx.Client) -> int:
    return admin.get("/admin/weight_version").json()["weight_version"]


def begin(admin: httpx.Client, named: list, version: int) -> httpx.Response:
    return admin.post(
        "/admin/update_weights/begin",
        json={"version": version, "tensors": [s.to_dict() for s in specs_of(named)]},
    )


def send_bucket(admin: httpx.Client, update_id: str, payload: bytes) -> httpx.Response:
    return admin.post(
        f"/admin/update_weights/{update_id}/bucket",
        content=payload,
        headers={"Content-Type": "application/octet-stream"},
    )


def update(admin: httpx.Client, named: list, bucket_bytes: int = 20_000) -> int:
    """The whole transaction over HTTP (many small buckets); the new version."""
    version = version_of(admin) + 1
    response = begin(admin, named, version)
    assert response.status_code == 200, response.text
    update_id = response.json()["update_id"]
    for bucket in iter_buckets(named, bucket_bytes):
        answer = send_bucket(admin, update_id, encode_bucket(bucket))
        assert answer.json() == {"tensors": len(bucket)}, answer.text
    assert admin.post(f"/admin/update_weights/{update_id}/commit").json() == {
        "weight_version": version
    }
    return version


def generate(user: httpx.Client, max_new: int = 8, **sampling) -> dict:
    response = user.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": max_new,
                "temperature": 0,
                "ignore_eos": True,
                **sampling,
            },
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream_lines(user: httpx.Client, rid: str, **sampling):
    """A streamed /generate of LONG greedy tokens: (context manager, iterator of its items)."""
    import json

    body = {
        "input_ids": PROMPT,
        "rid": rid,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": LONG,
            "temperature": 0,
            "ignore_eos": True,
            **sampling,
        },
    }
    context = user.stream("POST", "/generate", json=body)
    response = context.__enter__()
    assert response.status_code == 200

    def items():
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])

    return context, items()


def run_midway(user: httpx.Client, rid: str, action, **sampling) -> dict:
    """Stream a long request, call `action()` once a few tokens are out, and return the
    request's last item."""
    context, items = stream_lines(user, rid, **sampling)
    try:
        for _, item in zip(range(3), items):
            assert not item["meta_info"]["finish_reason"]
        action()
        last = None
        for last in items:
            pass
        return last
    finally:
        context.__exit__(None, None, None)


def wait_idle(engine: LLMEngine) -> None:
    import time

    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# --- auth ---------------------------------------------------------------------------------------


def test_admin_routes_need_the_admin_key(admin_server, admin, user):
    with _client(admin_server, None) as anonymous:
        response = anonymous.get("/admin/weight_version")
        assert response.status_code == 401 and "admin key" in response.json()["error"]["message"]
        assert anonymous.post("/admin/pause", json={"mode": "abort"}).status_code == 401
    for call in (
        lambda c: c.get("/admin/weight_version"),
        lambda c: c.post("/admin/pause", json={"mode": "abort"}),
        lambda c: c.post("/admin/update_weights/x/bucket", content=b"1" * 100),
    ):
        response = call(user)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "forbidden"
    assert admin.get("/admin/weight_version").status_code == 200
    assert admin.get("/v1/models").status_code == 401  # the admin key is not a user key
    assert user.get("/v1/models").status_code == 200


def test_no_admin_key_means_no_admin_routes(http):
    assert http.get("/admin/weight_version").status_code == 404


def test_admin_key_must_differ_from_user_keys(probe):
    with pytest.raises(ValueError, match="differ"):
        build_app(probe, api_keys=["k"], admin_api_key="k")


# --- pause and resume ---------------------------------------------------------------------------


def test_pause_is_idempotent_and_requests_wait_for_resume(admin, user):
    version = version_of(admin)
    for _ in range(2):
        assert admin.post("/admin/pause", json={"mode": "keep"}).json() == {
            "paused": True,
            "mode": "keep",
            "weight_version": version,
        }
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(generate(user, 4)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not answers  # queued while paused
    for _ in range(2):
        assert admin.post("/admin/resume").json() == {"paused": False, "weight_version": version}
    waiter.join(30)
    assert len(answers[0]["output_ids"]) == 4


def test_bad_pause_mode_is_400(admin):
    response = admin.post("/admin/pause", json={"mode": "sleep"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "mode"


def test_pause_wait_lets_the_running_request_finish(admin, user, admin_engine):
    paused = {}
    last = run_midway(
        user,
        "wait-1",
        lambda: paused.update(admin.post("/admin/pause", json={"mode": "wait"}).json()),
    )
    assert paused["mode"] == "wait" and not admin_engine.has_unfinished_requests()
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == LONG


def test_pause_abort_ends_the_running_request_with_its_partial_output(admin, user, admin_engine):
    last = run_midway(
        user, "abort-mode", lambda: admin.post("/admin/pause", json={"mode": "abort"})
    )
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < LONG
    admin.post("/admin/resume")
    wait_idle(admin_engine)


def test_abort_returns_partial_outputs_and_frees_every_block(admin, user, admin_engine):
    aborted = {}

    def abort():
        aborted.update(
            admin.post("/admin/abort", json={"request_ids": ["to-abort", "unknown"]}).json()
        )

    last = run_midway(user, "to-abort", abort)
    [item] = aborted["outputs"]
    assert item["meta_info"]["id"] == "to-abort"
    assert item["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(item["output_ids"]) < LONG
    assert item["output_ids"] == last["output_ids"]  # what the client got, too
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(item["meta_info"]["weight_versions"]) == len(item["output_ids"])
    wait_idle(admin_engine)


# --- weight updates -------------------------------------------------------------------------------


def test_update_over_http_equals_hf_on_the_new_weights(admin, user, weights):
    v0_dir, v0 = weights["v0"]
    v1_dir, v1 = weights["v1"]
    update(admin, v0)
    before = generate(user)
    assert before["output_ids"] == hf_greedy(v0_dir, PROMPT, 8)[0]
    version = update(admin, v1)
    after = generate(user)
    assert after["output_ids"] == hf_greedy(v1_dir, PROMPT, 8)[0] != before["output_ids"]
    meta = after["meta_info"]
    assert meta["weight_version"] == version and meta["weight_versions"] == [version] * 8
    assert meta["cached_tokens"] == 0  # the prompt was cached under the old version
    assert admin.post("/admin/resume").json()["paused"] is False  # the update resumed


def test_retract_continues_exactly_as_fresh_new_weights(admin, user, weights):
    v0_dir, v0 = weights["v0"]
    v1_dir, v1 = weights["v1"]
    old = update(admin, v0)
    new = {}

    def retract_and_update():
        admin.post("/admin/pause", json={"mode": "retract"})
        new["version"] = update(admin, v1)
        admin.post("/admin/resume")

    last = run_midway(user, "retracted", retract_and_update)
    ids, versions = last["output_ids"], last["meta_info"]["weight_versions"]
    k = versions.index(new["version"])
    assert 0 < k and versions == [old] * k + [new["version"]] * (LONG - k)
    assert ids[: min(k, 12)] == hf_greedy(v0_dir, PROMPT, min(k, 12))[0]
    assert ids[k : k + 12] == hf_greedy(v1_dir, PROMPT + ids[:k], 12)[0]


def test_max_weight_lag_ends_a_request_as_stale(admin, user, weights):
    old = update(admin, weights["v0"][1])

    def keep_and_update():
        admin.post("/admin/pause", json={"mode": "keep"})
        update(admin, weights["v1"][1])
        admin.post("/admin/resume")

    last = run_midway(user, "stale-1", keep_and_update, max_weight_lag=0)
    assert last["meta_info"]["finish_reason"]["type"] == "stale"
    assert 0 < len(last["output_ids"]) < LONG
    assert last["meta_info"]["weight_versions"] == [old] * len(last["output_ids"])


def test_bad_update_is_400_and_changes_nothing(admin, user, weights, admin_engine):
    _, v1 = weights["v1"]
    update(admin, v1)
    version, before = version_of(admin), generate(user)
    i, (name, tensor) = next((i, t) for i, t in enumerate(v1) if "q_proj" in t[0])
    wrong = v1[:i] + [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))] + v1[i + 1 :]
    unknown = [("model.layers.99.mlp.up_proj.weight", tensor)]
    for named, says in ((wrong, "(65, 64)"), (unknown, "layers.99")):
        response = begin(admin, named, version + 1)
        assert response.status_code == 400 and says in response.json()["error"]["message"]
    assert begin(admin, v1, version).status_code == 400  # not newer
    # a begun update: a bucket outside its manifest, or not safetensors, changes nothing
    update_id = begin(admin, v1[:2], version + 1).json()["update_id"]
    for payload in (encode_bucket(v1[2:3]), b"\x00" * 64):
        response = send_bucket(admin, update_id, payload)
        assert response.status_code == 400, response.text
    commit = admin.post(f"/admin/update_weights/{update_id}/commit")
    assert commit.status_code == 400 and "0 of the update's 2" in commit.text
    assert admin.post("/admin/resume").status_code == 200  # nothing loaded: dropped
    assert admin.post(f"/admin/update_weights/{update_id}/commit").status_code == 404
    assert version_of(admin) == version == admin_engine.weight_version
    after = generate(user)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_versions"] == before["meta_info"]["weight_versions"]


def test_a_bucket_may_exceed_the_body_limit(admin, user, weights):
    from safetensors.torch import save

    _, v0 = weights["v0"]
    update(admin, v0)
    name, tensor = v0[0]
    padded = save({name: tensor}, metadata={"pad": "x" * (MAX_BODY + 1000)})  # the same weights
    version = version_of(admin) + 1
    update_id = begin(admin, v0[:1], version).json()["update_id"]
    assert send_bucket(admin, update_id, padded).json() == {"tensors": 1}
    assert admin.post(f"/admin/update_weights/{update_id}/commit").json()["weight_version"] == (
        version
    )
    too_big = {"mode": "keep", "pad": "x" * (MAX_BODY + 1000)}
    assert admin.post("/admin/pause", json=too_big).status_code == 413  # other routes: no
    assert user.post("/generate", json=too_big).status_code == 413


# --- the version everywhere, kept mass ------------------------------------------------------------


def test_weight_version_is_in_every_answer(admin, user, weights):
    version = update(admin, weights["v1"][1])
    assert generate(user)["meta_info"]["weight_version"] == version
    assert user.get("/v1/models").json()["data"][0]["weight_version"] == version
    assert user.get(f"/v1/models/{MODEL}").json()["weight_version"] == version
    assert (
        f'raylane:weight_version{{model_name="{MODEL}"}} {float(version)}'
        in user.get("/metrics").text
    )
    completion = user.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert completion.json()["weight_version"] == version
    chat = user.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.json()["weight_version"] == version
    with user.stream(
        "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}
    ) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks and all(f'"weight_version": {version}' in c for c in chunks)


def test_kept_mass_over_generate(user):
    def kept(**sampling) -> list[float]:
        meta = generate(user, 6, temperature=1.0, seed=3, return_kept_mass=True, **sampling)[
            "meta_info"
        ]
        assert len(meta["kept_mass_logprobs"]) == meta["completion_tokens"] == 6
        return meta["kept_mass_logprobs"]

    assert kept() == pytest.approx([0.0] * 6, abs=1e-5)  # no truncation keeps everything
    truncated = kept(top_k=3)
    assert all(x <= 1e-6 for x in truncated) and min(truncated) < -1e-3
    assert "kept_mass_logprobs" not in generate(user)["meta_info"]
