"""The admin routes' weight updates over HTTP on the real engine: safetensors buckets, retract
and stale requests across an update, bad updates, and the weight version in every answer.

References: Hugging Face `generate` on the weights each update sends (v0: the checkpoint, v1:
seeded noise on it, saved as its own model). The server here has its own engine
(`admin_server`, tests/e2e/conftest.py), so updates do not reach the other e2e tests; each test
first loads the weights it needs.
"""

from __future__ import annotations

import pytest
import torch
from raylane.actors.models.weights import encode_bucket

from tests.e2e.admin_helpers import (
    LONG,
    PROMPT,
    begin,
    generate,
    run_midway,
    send_bucket,
    update,
    version_of,
)
from tests.e2e.conftest import MAX_BODY, MODEL
from tests.hf_reference import hf_greedy

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
