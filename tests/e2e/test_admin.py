"""The admin routes (RL control plane) over HTTP on the real engine: admin auth, pause modes and
aborts (weight updates: test_admin_weights.py). The server here has its own engine
(`admin_server`, tests/e2e/conftest.py), so its pauses do not reach the other e2e tests.
"""

from __future__ import annotations

import threading

import pytest
from raylane.session_server.app import build_app

from tests.e2e.admin_helpers import (
    LONG,
    generate,
    keyed_client,
    run_midway,
    version_of,
    wait_idle,
)

# --- auth ---------------------------------------------------------------------------------------


def test_admin_routes_need_the_admin_key(admin_server, admin, user):
    with keyed_client(admin_server, None) as anonymous:
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
