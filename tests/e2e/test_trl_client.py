"""TRL's own `VLLMClient` (trl.generation.vllm_client, TRL >= 1.16: it speaks vLLM's API) against
the trainer API: generation from ids and from text, chat, the world size, the server info, the
prefix-cache reset and the tokens route, checked against Hugging Face greedy decoding.

The client refuses to start without vLLM installed (it imports vLLM's NCCL helper for its
weight sync, which is not used here), so that one guard is switched off; every request is the
client's own. Its NCCL weight transfer is not exercised (no GPU, and it is another route).
"""

from __future__ import annotations

import pytest

from tests.e2e.admin_helpers import PROMPT
from tests.hf_reference import hf_greedy

vllm_client = pytest.importorskip("trl.generation.vllm_client")


@pytest.fixture
def client(trainer_server, trainer, monkeypatch):
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    return vllm_client.VLLMClient(base_url=trainer_server.url, connection_timeout=10)


GREEDY = {"temperature": 0.0, "max_tokens": 8, "generation_kwargs": {"ignore_eos": True}}


def test_generate_from_ids_equals_hf(client, tiny_llama_dir):
    out = client.generate([PROMPT, PROMPT[:4]], logprobs=2, **GREEDY)
    assert out["prompt_ids"] == [PROMPT, PROMPT[:4]]
    for prompt, ids, logprobs, lp_ids in zip(
        out["prompt_ids"], out["completion_ids"], out["logprobs"], out["logprob_token_ids"]
    ):
        want_ids, want_lps = hf_greedy(tiny_llama_dir, prompt, 8)
        assert ids == want_ids
        # greedy: the sampled token is the most likely, so it heads each (sorted) position
        assert [p[0] for p in lp_ids] == want_ids
        assert [p[0] for p in logprobs] == pytest.approx(want_lps, abs=1e-4)
        # the top 2, the sampled one among them (greedy), so no third entry
        assert all(len(p) == 2 and p[0] >= p[1] for p in logprobs)


def test_generate_from_text_and_n(client, trainer_backend, tiny_llama_dir):
    out = client.generate(["Hello there"], n=2, **GREEDY)
    want = trainer_backend.tokenizer.encode("Hello there")
    assert out["prompt_ids"] == [want]
    assert out["completion_ids"] == [hf_greedy(tiny_llama_dir, want, 8)[0]] * 2


def test_chat_equals_hf_on_the_templated_prompt(client, tiny_llama_dir):
    out = client.chat([[{"role": "user", "content": "Hi!"}]], logprobs=0, **GREEDY)
    (prompt,) = out["prompt_ids"]
    assert out["completion_ids"] == [hf_greedy(tiny_llama_dir, prompt, 8)[0]]
    assert [p[0] for p in out["logprob_token_ids"][0]] == out["completion_ids"][0]


def test_world_size_server_info_and_cache_reset(client):
    assert client.get_world_size() == 1
    config = client.get_server_info()
    assert config["parallel_config"]["tensor_parallel_size"] == 1
    client.reset_prefix_cache()


def test_tokens_route_as_the_client_sends_it(client, tiny_llama_dir):
    sampling = {"temperature": 0.0, "max_tokens": 6, "logprobs": 0, "ignore_eos": True}
    out = client._generate_from_features([PROMPT], [None], sampling)
    assert out["completion_ids"] == [hf_greedy(tiny_llama_dir, PROMPT, 6)[0]]
