"""The trainer protocols' SGLang native routes and TRL's former vllm-serve routes over HTTP on
the real engine (the trainer server of tests/e2e/conftest.py), as slime's and TRL's clients
send them: pause modes by their effect on a request in flight, generation against Hugging Face,
the update from disk as one transaction, the weights checker."""

from __future__ import annotations

import dataclasses

import pytest

from tests.e2e.admin_helpers import LONG, PROMPT, run_midway
from tests.hf_reference import hf_greedy


def test_sglang_server_info_has_the_keys_slime_compares(trainer, tiny_llama_dir):
    for path in ("/server_info", "/get_server_info"):
        info = trainer.get(path).json()
        assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
        assert info["model_path"] == tiny_llama_dir
        assert info["enable_return_routed_experts"] is False
        assert info["enable_deterministic_inference"] is info["batch_invariant"] is False
        assert info["weight_version"] == trainer.get("/get_weight_version").json()["weight_version"]
        assert info["vllm_config"]["parallel_config"]["tensor_parallel_size"] == 1


def test_sglang_server_info_says_when_the_mode_is_batch_invariant(
    trainer, trainer_backend, monkeypatch
):
    on = dataclasses.replace(trainer_backend.info, batch_invariant=True)
    monkeypatch.setattr(trainer_backend, "info", on)
    info = trainer.get("/server_info").json()
    assert info["enable_deterministic_inference"] is info["batch_invariant"] is True


def test_sglang_pause_in_place_and_continue(trainer, tiny_llama_dir):
    def pause_and_continue():
        answer = trainer.post("/pause_generation", json={"mode": "in_place"}).json()
        assert answer["status"] == "ok"
        assert trainer.get("/is_paused").json() == {"is_paused": True}
        assert trainer.post("/continue_generation").json()["status"] == "ok"

    last = run_midway(trainer, "in-place-1", pause_and_continue)
    assert last["output_ids"] == hf_greedy(tiny_llama_dir, PROMPT, LONG)[0]


def test_sglang_pause_retract_re_prefills_to_the_same_tokens(trainer, tiny_llama_dir):
    def pause_and_continue():
        trainer.post("/pause_generation", json={"mode": "retract"})
        trainer.post("/continue_generation")

    last = run_midway(trainer, "retract-1", pause_and_continue)
    assert last["output_ids"] == hf_greedy(tiny_llama_dir, PROMPT, LONG)[0]


def test_sglang_abort_request_by_rid(trainer):
    last = run_midway(
        trainer, "sgl-abort", lambda: trainer.post("/abort_request", json={"rid": "sgl-abort"})
    )
    finish = last["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and isinstance(finish["message"], str)  # SGLang's shape
    last = run_midway(
        trainer, "sgl-all", lambda: trainer.post("/abort_request", json={"abort_all": True})
    )
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    response = trainer.post("/abort_request", json={})
    assert response.status_code == 400 and response.json()["error"]["param"] == "rid"


def test_sglang_health_generate_loads_and_flush(trainer):
    assert trainer.get("/health_generate").status_code == 200
    loads = trainer.get("/v1/loads").json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["dp_rank"] == 0
    for method in ("GET", "POST"):
        assert trainer.request(method, "/flush_cache").status_code == 200


def test_generate_answers_sglang_types_with_the_trainer_api(trainer, tiny_llama_dir):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    item = trainer.post("/generate", json=body).json()
    ids, logprobs = hf_greedy(tiny_llama_dir, PROMPT, 6)
    meta = item["meta_info"]
    version = trainer.get("/get_weight_version").json()["weight_version"]
    assert item["output_ids"] == ids and meta["weight_version"] == version  # a string
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 6)


def test_trl_trailing_slash_routes(trainer):
    assert trainer.get("/health/").json() == {"status": "ok"}
    assert trainer.get("/get_world_size/").json() == {"world_size": 1}
    assert trainer.get("/get_tensor_parallel_size/").json() == {"tensor_parallel_size": 1}
    assert "resetting prefix cache" in trainer.post("/reset_prefix_cache/").json()["message"]


def test_update_from_disk_is_one_transaction(trainer, tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    from tests.hf_reference import perturbed_model

    v1_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v1"), 31)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = int(trainer.get("/get_weight_version").json()["weight_version"])
    old = trainer.post("/generate", json=body).json()["output_ids"]
    # another architecture's checkpoint: refused by every rank's check before any byte moves
    wrong = trainer.post("/update_weights_from_disk", json={"model_path": tiny_qwen3_dir})
    assert wrong.status_code == 400 and wrong.json()["error"]["message"]
    missing = trainer.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_path"
    assert trainer.get("/get_weight_version").json()["weight_version"] == str(before)
    assert trainer.post("/generate", json=body).json()["output_ids"] == old
    assert trainer.get("/is_paused").json() == {"is_paused": False}  # the failed begin resumed
    answer = trainer.post(
        "/update_weights_from_disk",
        json={"model_path": v1_dir, "weight_version": str(before + 5)},
    ).json()
    assert answer["success"] is True, answer
    new = trainer.post("/generate", json=body).json()
    assert new["output_ids"] == hf_greedy(v1_dir, PROMPT, 6)[0] != old
    assert new["meta_info"]["weight_version"] == str(before + 5)
    # back to the checkpoint the other tests expect
    trainer.post("/update_weights_from_disk", json={"model_path": tiny_llama_dir})
    assert trainer.post("/generate", json=body).json()["output_ids"] == old


def test_sglang_weights_checker_snapshot_reset_compare(trainer, tiny_llama_dir):
    def check(action: str) -> dict:
        return trainer.post("/weights_checker", json={"action": action}).json()

    assert check("snapshot")["success"] is True
    assert check("compare") == {
        "success": True,
        "message": "the weights equal the snapshot",
        "mismatches": [],
    }
    assert check("reset_tensors")["success"] is True
    assert check("compare")["success"] is False
    trainer.post("/update_weights_from_disk", json={"model_path": tiny_llama_dir})
    assert check("compare")["success"] is True
    assert "lm_head.weight" in check("checksum")["checksums"]


def test_trl_former_generate_and_chat_equal_hf(trainer, trainer_backend, tiny_llama_dir):
    sampling = {"temperature": 0.0, "max_tokens": 5, "generation_kwargs": {"ignore_eos": True}}
    out = trainer.post("/generate/", json={"prompts": ["Hi there", "Bye"], "n": 2, **sampling})
    out = out.json()
    encoded = [trainer_backend.tokenizer.encode(p) for p in ("Hi there", "Bye")]
    assert out["prompt_ids"] == encoded  # one per prompt, as TRL's server answers
    repeated = [encoded[0], encoded[0], encoded[1], encoded[1]]  # n = 2 completions each
    for prompt, ids, logprobs in zip(repeated, out["completion_ids"], out["logprobs"]):
        want_ids, want_lps = hf_greedy(tiny_llama_dir, prompt, 5)
        assert ids == want_ids and logprobs == pytest.approx(want_lps, abs=1e-4)
    chat = trainer.post(
        "/chat/", json={"messages": [[{"role": "user", "content": "Hi!"}]], **sampling}
    ).json()
    (prompt,) = chat["prompt_ids"]
    assert chat["completion_ids"] == [hf_greedy(tiny_llama_dir, prompt, 5)[0]]
    bad = trainer.post("/generate/", json={"prompts": ["x"], "generation_kwargs": {"nope": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "generation_kwargs"


def test_trl_0_29_generate_shape_equals_hf(trainer, tiny_llama_dir):
    """TRL 0.25-0.29's client sends token ids, `logprobs` (top N) and its other fields, and
    reads per token the top N most likely first, their ids beside them."""
    body = {
        "prompts": [PROMPT, PROMPT[:5]], "images": None, "n": 1, "repetition_penalty": 1.0,
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 5,
        "logprobs": 2, "truncate_prompt_tokens": None, "structured_outputs_regex": None,
        "generation_kwargs": {"ignore_eos": True},
    }  # fmt: skip
    out = trainer.post("/generate/", json=body).json()
    assert out["prompt_ids"] == [PROMPT, PROMPT[:5]]
    for prompt, ids, lps, lp_ids in zip(
        out["prompt_ids"], out["completion_ids"], out["logprobs"], out["logprob_token_ids"]
    ):
        want_ids, want_lps = hf_greedy(tiny_llama_dir, prompt, 5)
        assert ids == want_ids and [t[0] for t in lp_ids] == want_ids  # greedy: rank 1
        assert [p[0] for p in lps] == pytest.approx(want_lps, abs=1e-4)
        assert all(len(p) == 2 and p[0] >= p[1] for p in lps)
    truncated = trainer.post("/generate/", json={**body, "truncate_prompt_tokens": 3}).json()
    assert truncated["prompt_ids"] == [PROMPT[-3:], PROMPT[2:5]]
