"""SGLang's own client against the trainer API: its frontend's `RuntimeEndpoint` (SGLang
0.5.23, installed `--no-deps` by the Makefile: the package pins CUDA builds; its client needs
none) asks `/get_model_info`, generates through `/generate` with SGLang's sampling fields and
reads SGLang's `meta_info`, flushes the cache and reads `/server_info`. The greedy tokens and
their logprobs must equal Hugging Face's on the same prompt tokens."""

from __future__ import annotations

import pytest
import sglang as sgl
from transformers import AutoTokenizer

from tests.hf_reference import hf_greedy

TEXT = "Hello there, how are"


@sgl.function
def complete(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=6, temperature=0, ignore_eos=True, return_logprob=True)


def test_sglang_runtime_endpoint_generates_hf_greedy(trainer_server, trainer, tiny_llama_dir):
    backend = sgl.RuntimeEndpoint(trainer_server.url)
    assert backend.get_model_name() == tiny_llama_dir  # from /get_model_info
    state = complete.run(prompt=TEXT, backend=backend)
    meta = state.get_meta_info("out")
    assert meta is not None, state.error()
    prompt_ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(TEXT).input_ids
    ids, logprobs = hf_greedy(tiny_llama_dir, prompt_ids, 6)
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    backend.flush_cache()
    assert backend.get_server_info()["tp_size"] == 1


def test_stop_regex_is_refused_unless_empty(trainer):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "stop_regex": None}}
    assert trainer.post("/generate", json=body).status_code == 200
    body["sampling_params"]["stop_regex"] = "a+"
    answer = trainer.post("/generate", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop_regex"
