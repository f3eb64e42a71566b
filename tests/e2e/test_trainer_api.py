"""The trainer protocols (`build_app(trainer_api=True)`) over HTTP on the real engine: mounting,
the admin key guarding what changes state, and vLLM's RL API as its clients call it (documented
request shapes, sent with httpx; TRL's own client: test_trl_client.py). Pause modes are checked
by their effect on a request in flight; generation against Hugging Face. The trainer server has
its own engine (tests/e2e/conftest.py), so pauses do not reach the other e2e tests. SGLang's
and TRL's former routes: test_trainer_sglang_trl.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from raylane.session_server.app import build_app

from tests.e2e.admin_helpers import LONG, PROMPT, run_midway
from tests.e2e.conftest import MAX_BODY
from tests.e2e.server import ServerThread
from tests.hf_reference import hf_greedy
from tests.weight_versions import everywhere_as, versions_everywhere

ADMIN_KEY = "trainer-admin"
USER_KEY = "trainer-user"


@pytest.fixture(scope="module")
def keyed_server(trainer_backend) -> Iterator[ServerThread]:
    app = build_app(
        trainer_backend,
        trainer_api=True,
        api_keys=[USER_KEY],
        admin_api_key=ADMIN_KEY,
        max_body_bytes=MAX_BODY,
    )
    with ServerThread(app) as srv:
        yield srv


def client_of(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, timeout=60, headers=headers)


# --- mounting and auth -----------------------------------------------------------------------


def test_trainer_routes_exist_only_when_turned_on(http):
    for path in ("/is_paused", "/get_world_size", "/server_info", "/get_world_size/"):
        assert http.get(path).status_code == 404, path


def test_state_changing_routes_need_the_admin_key_when_one_is_set(keyed_server):
    with (
        client_of(keyed_server, None) as anonymous,
        client_of(keyed_server, USER_KEY) as user,
        client_of(keyed_server, ADMIN_KEY) as admin,
    ):
        for path in ("/pause?mode=keep", "/pause_generation", "/reset_prefix_cache/"):
            assert anonymous.post(path).status_code == 401, path
            response = user.post(path)
            assert response.status_code == 403, path
            assert response.json()["error"]["code"] == "forbidden"
        assert anonymous.get("/is_paused").status_code == 401  # a user route: the user key
        assert user.get("/is_paused").json() == {"is_paused": False}
        assert admin.post("/pause?mode=keep").json() == {"status": "paused"}
        assert user.get("/is_paused").json() == {"is_paused": True}
        assert admin.post("/resume").json() == {"status": "resumed"}
        assert user.get("/is_paused").json() == {"is_paused": False}


# --- vLLM's RL API ---------------------------------------------------------------------------


def test_vllm_pause_keep_freezes_the_request_and_resume_continues_it(
    trainer, trainer_engine, tiny_llama_dir
):
    def pause_and_resume():
        assert trainer.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert trainer.get("/is_paused").json() == {"is_paused": True}
        held = trainer_engine.has_unfinished_requests()
        assert trainer.post("/resume").json() == {"status": "resumed"}
        assert held  # kept with its KV, not ended

    last = run_midway(trainer, "keep-1", pause_and_resume)
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    expected, _ = hf_greedy(tiny_llama_dir, PROMPT, LONG)
    assert last["output_ids"] == expected  # frozen and continued: the same greedy tokens


def test_vllm_pause_abort_ends_the_request_and_clears_the_cache(trainer, trainer_engine):
    last = run_midway(trainer, "abort-1", lambda: trainer.post("/pause", params={"mode": "abort"}))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < LONG
    assert not trainer_engine.block_manager.cached  # clear_cache (the default)


def test_vllm_pause_wait_lets_the_request_finish(trainer, trainer_engine):
    last = run_midway(trainer, "wait-1", lambda: trainer.post("/pause", params={"mode": "wait"}))
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == LONG and not trainer_engine.has_unfinished_requests()


def test_vllm_bad_pause_mode_is_a_400_in_the_openai_body(trainer):
    response = trainer.post("/pause", params={"mode": "sleep"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_vllm_abort_requests_ends_named_or_all(trainer):
    ended = {}
    last = run_midway(
        trainer,
        "abort-named",
        lambda: ended.update(trainer.post("/abort_requests", json={}).json()),
    )
    assert ended == {"status": "aborted", "aborted": 1}
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert trainer.post("/abort_requests", json={"request_ids": ["nope"]}).json() == {
        "status": "aborted",
        "aborted": 0,
    }


def test_vllm_info_routes(trainer):
    assert trainer.get("/get_world_size").json() == {"world_size": 1}
    assert trainer.get("/get_world_size", params={"include_dp": False}).json() == {"world_size": 1}
    version = trainer.get("/weight_info").json()["weight_version"]
    assert (
        version.isdigit() and version == trainer.get("/get_weight_version").json()["weight_version"]
    )
    assert trainer.post("/reset_prefix_cache").status_code == 200


def test_requests_queued_while_paused_run_after_resume(trainer):
    trainer.post("/pause", params={"mode": "keep"})
    answers: list = []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    waiter = threading.Thread(target=lambda: answers.append(trainer.post("/generate", json=body)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not answers
    trainer.post("/resume")
    waiter.join(30)
    assert answers[0].status_code == 200


def test_version_update_under_keep_splits_the_in_flight_tokens(trainer, tiny_llama_dir):
    """The request frozen by `keep` carries version v before the update and v + 1 after;
    /weight_info and /get_weight_version agree, and a version that is no label is refused."""
    before = int(trainer.get("/weight_info").json()["weight_version"])

    def bump():
        trainer.post("/pause", params={"mode": "keep"})
        answer = trainer.post("/update_weight_version", json={"new_version": str(before + 1)})
        assert answer.json() == {
            "success": True,
            "message": f"Weight version updated to {before + 1}",
            "new_version": str(before + 1),
        }
        trainer.post("/resume")

    last = run_midway(trainer, "versions-1", bump)
    versions = last["meta_info"]["weight_versions"]
    cut = versions.index(before + 1)
    assert 0 < cut and versions == [before] * cut + [before + 1] * (LONG - cut)
    assert last["output_ids"] == hf_greedy(tiny_llama_dir, PROMPT, LONG)[0]  # same weights
    for path in ("/weight_info", "/get_weight_version"):
        assert trainer.get(path).json() == {"weight_version": str(before + 1)}
    for bad in (True, ["7"], "x" * 300):
        response = trainer.post("/update_weight_version", json={"new_version": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "new_version"
    assert trainer.get("/weight_info").json() == {"weight_version": str(before + 1)}


# --- weight versions as labels --------------------------------------------------------------
# NOTE: each test ends on an integer label equal to raylane's own integer, as the server's
# other tests (which read the version as a number) expect


def lifecycle(trainer: httpx.Client, label: str | int | None) -> httpx.Response:
    """vLLM's update sequence, with no tensors (the weights stay): pause(keep), start,
    finish labelled `label`, resume. The finish's answer."""
    assert trainer.post("/pause", params={"mode": "keep"}).status_code == 200
    assert trainer.post("/start_weight_update", json={}).status_code == 200
    finished = trainer.post("/finish_weight_update", json={"weight_version": label})
    assert trainer.post("/resume").status_code == 200
    return finished


def read_back(server: ServerThread) -> dict:
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await versions_everywhere(http)

    return asyncio.run(go())


def test_vllm_labels_are_what_every_trainer_route_answers(
    trainer, trainer_server, trainer_engine, keyed_server
):
    """ "step-42", then "v2", then an integer: each is what every vLLM and SGLang route
    answers, and raylane's own integer grows by one per commit (its admin route and
    RolloutClient give both). An integer that is not newer is a label too."""
    from raylane.client import RolloutClient

    start = trainer_engine.weight_version
    for label in ("step-42", "v2", start + 3):
        assert lifecycle(trainer, label).json() == {"message": "Weight update finished"}
        assert read_back(trainer_server) == everywhere_as(str(label))
        if label == "v2":
            with client_of(keyed_server, ADMIN_KEY) as admin:
                own = admin.get("/admin/weight_version").json()
            assert own == {"weight_version": start + 2, "weight_label": "v2"}
    assert trainer_engine.weight_version == start + 3
    answer = trainer.post("/update_weight_version", json={"new_version": str(start)}).json()
    assert answer["new_version"] == str(start) and trainer_engine.weight_version == start + 4
    assert trainer.get("/weight_info").json() == {"weight_version": str(start)}

    async def own_view() -> tuple:
        async with RolloutClient(keyed_server.url, admin_key=ADMIN_KEY) as client:
            return await client.weight_version(), await client.weight_label()

    assert asyncio.run(own_view()) == (start + 4, str(start))
    trainer.post("/update_weight_version", json={"new_version": start + 5})


def test_the_same_label_twice_is_two_versions_to_the_prefix_cache(trainer, trainer_engine):
    prompt = list(range(60, 100))  # two full 16-token blocks to share

    def cached() -> int:
        usage = tokens(trainer, prompt).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    start = trainer_engine.weight_version
    lifecycle(trainer, "same")
    assert [cached(), cached()] == [0, 32]
    lifecycle(trainer, "same")
    assert cached() == 0  # a new version roots new chains, whatever its label
    assert trainer_engine.weight_version == start + 2
    lifecycle(trainer, start + 3)


def test_a_refused_finish_leaves_the_update_open_and_says_what_next(trainer, trainer_engine):
    """A finish refused for its body commits nothing; the update stays open, so sending the
    finish again commits it, and /abort_weight_update drops it instead."""
    start = trainer_engine.weight_version
    trainer.post("/pause", params={"mode": "keep"})
    trainer.post("/start_weight_update", json={})
    for bad in ({"weight_version": ["x"]}, {"weight_version": True}, {"weight_version": "x" * 300}):
        error = trainer.post("/finish_weight_update", json=bad).json()["error"]
        assert error["param"] == "weight_version", bad
        assert "stays open" in error["message"] and "/abort_weight_update" in error["message"]
    not_json = trainer.post(
        "/finish_weight_update", content=b"{", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400 and "stays open" in not_json.json()["error"]["message"]
    assert trainer.get("/is_paused").json() == {"is_paused": True}
    assert trainer_engine.weight_version == start
    again = trainer.post("/finish_weight_update", json={"weight_version": start + 1})
    assert again.status_code == 200 and trainer_engine.weight_version == start + 1

    trainer.post("/start_weight_update", json={})
    trainer.post("/finish_weight_update", json={"weight_version": 1.5})
    assert trainer.post("/abort_weight_update").json() == {"message": "Weight update aborted"}
    assert trainer.post("/finish_weight_update", json={}).status_code == 404  # none is open
    assert trainer.post("/resume").json() == {"status": "resumed"}
    assert trainer_engine.weight_version == start + 1
    assert trainer.get("/weight_info").json() == {"weight_version": str(start + 1)}


# --- vLLM's tokens-in / tokens-out route -----------------------------------------------------


def tokens(trainer: httpx.Client, prompt: list[int], **fields) -> httpx.Response:
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2},
        **fields,
    }
    return trainer.post("/inference/v1/generate", json=body)


def test_vllm_tokens_route_equals_hf_greedy(trainer, tiny_llama_dir):
    answer = tokens(trainer, PROMPT, request_id="tok-1").json()
    ids, logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
    (choice,) = answer["choices"]
    assert answer["request_id"] == "tok-1" and choice["token_ids"] == ids
    assert choice["finish_reason"] == "length" and choice["routed_experts"] is None
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert [e["logprob"] for e in content] == pytest.approx(logprobs, abs=1e-4)
    # the sampled token first, then the most likely others: greedy picks the top one itself
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 8)
    assert answer["weight_version"] == trainer.get("/weight_info").json()["weight_version"]


def test_vllm_tokens_cache_salt_separates_prefix_caches(trainer):
    prompt = list(range(3, 3 + 40))  # two full 16-token blocks to share
    cached = [
        tokens(trainer, prompt, cache_salt=salt).json()["usage"]["prompt_tokens_details"]
        for salt in ("a", "a", "b", None)
    ]
    assert [c["cached_tokens"] for c in cached] == [0, 32, 0, 0]


def test_vllm_tokens_route_names_what_it_cannot_take(trainer):
    response = tokens(trainer, PROMPT, sampling_params={"logits_processors": ["x"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sampling_params.logits_processors"
    assert tokens(trainer, PROMPT, sampling_params={"top_p": 2.0}).status_code == 400
    assert tokens(trainer, [], sampling_params={}).status_code == 400
    inert = {"detokenize": True, "output_kind": 0, "max_tokens": 2, "top_k": -1}
    assert tokens(trainer, PROMPT, sampling_params=inert).status_code == 200


# --- sleep and the weight checkers -----------------------------------------------------------


def kv_elements(engine) -> int:
    layers = engine.executor.runner.model.attention_layers()
    return sum(layer.k_cache.numel() + layer.v_cache.numel() for layer in layers)


def test_sleep_frees_the_kv_cache_and_wake_up_serves_again(trainer, trainer_engine, tiny_llama_dir):
    held = kv_elements(trainer_engine)
    bad = trainer.post("/sleep", params={"level": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert trainer.get("/is_paused").json() == {"is_paused": False}  # refused before pausing
    last = run_midway(trainer, "sleep-1", lambda: trainer.post("/sleep", params={"level": 1}))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert trainer.get("/is_sleeping").json() == {"is_sleeping": True}
    assert kv_elements(trainer_engine) == 0 and held > 0
    resumed = trainer.post("/resume")
    assert resumed.status_code == 400 and "wake" in resumed.json()["error"]["message"]
    answers: list = []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    waiter = threading.Thread(target=lambda: answers.append(trainer.post("/generate", json=body)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # waits for the wake-up
    assert trainer.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert trainer.get("/is_sleeping").json() == {"is_sleeping": True}  # weights: no-op
    assert trainer.post("/wake_up", params={"tags": ["bogus"]}).status_code == 400
    assert trainer.post("/wake_up").status_code == 200
    waiter.join(30)
    assert answers[0].json()["output_ids"] == hf_greedy(tiny_llama_dir, PROMPT, 5)[0]
    assert kv_elements(trainer_engine) == held
    assert trainer.get("/is_sleeping").json() == {"is_sleeping": False}


def weight_elements(engine) -> int:
    """Every element the runner's weights hold: parameters and their oneDNN packs."""
    model = engine.executor.runner.model
    packs = [getattr(m, "packed", None) for m in model.modules()]
    return sum(p.numel() for p in model.parameters()) + sum(
        p.numel() for p in packs if p is not None
    )


def test_sleep_level_2_releases_the_weights_and_wake_up_restores_them(
    trainer, trainer_engine, tiny_llama_dir
):
    before = trainer.post("/weight_checker", json={"action": "checksum"}).json()
    held = weight_elements(trainer_engine)
    assert trainer.post("/sleep", params={"level": 2}).status_code == 200
    assert weight_elements(trainer_engine) == 0 and kv_elements(trainer_engine) == 0
    version = trainer.get("/weight_info").json()["weight_version"]
    refused = trainer.post("/update_weight_version", json={"new_version": int(version) + 1})
    assert refused.status_code == 400 and "wake_up" in refused.json()["error"]["message"]
    kv_first = trainer.post("/wake_up", params={"tags": ["kv_cache"]})
    assert kv_first.status_code == 400 and kv_first.json()["error"]["param"] == "tags"
    assert trainer.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert weight_elements(trainer_engine) == held and kv_elements(trainer_engine) == 0
    assert trainer.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache
    assert trainer.post("/wake_up").status_code == 200
    assert trainer.post("/weight_checker", json={"action": "checksum"}).json() == before
    answer = tokens(trainer, PROMPT).json()["choices"][0]["token_ids"]
    assert answer == hf_greedy(tiny_llama_dir, PROMPT, 8)[0]
    assert trainer.get("/weight_info").json()["weight_version"] == version


def test_vllm_weight_checker_proves_a_transfer_restores_the_weights(trainer, tiny_llama_dir):
    baseline = trainer.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert "lm_head.weight" in baseline
    compare = {"action": "compare", "baseline": baseline}
    assert trainer.post("/weight_checker", json=compare).json() == {
        "match": True,
        "mismatches": [],
    }
    assert trainer.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    after = trainer.post("/weight_checker", json=compare).json()
    assert after["match"] is False and set(after["mismatches"]) == set(baseline)
    trainer.post("/update_weights_from_disk", json={"model_path": tiny_llama_dir})
    assert trainer.post("/weight_checker", json=compare).json()["match"] is True
    trainer.post("/pause", params={"mode": "keep"})
    assert trainer.post("/weight_checker", json={"action": "checksum"}).status_code == 409


def test_vllm_tokens_route_streams_the_same_tokens(trainer, tiny_llama_dir):
    import json

    body = {
        "token_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    }
    with trainer.stream("POST", "/inference/v1/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert ids == hf_greedy(tiny_llama_dir, PROMPT, 6)[0]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
