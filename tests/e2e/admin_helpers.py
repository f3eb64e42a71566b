"""What the admin-route tests share (tests/e2e/test_admin*.py; their server and clients are
fixtures in tests/e2e/conftest.py): keys, a prompt, and the calls they make over HTTP. Other
e2e tests take the prompt and `run_midway` from here too."""

from __future__ import annotations

import httpx
from raylane.actors.engine import LLMEngine
from raylane.actors.models.weights import encode_bucket, iter_buckets, specs_of

from tests.e2e.server import ServerThread

ADMIN_KEY = "admin-secret"
USER_KEY = "user-key"
PROMPT = [5, 17, 42, 99, 7, 150, 33]
LONG = 200  # tokens: long enough to act on a request while it runs


def keyed_client(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, timeout=60, headers=headers)


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
