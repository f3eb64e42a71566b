"""vLLM's `prompt_logprobs` on `/v1/completions` through the `openai` client, checked against
Hugging Face's log_softmax over the prompt: each token's logprob and rank (1 + how many tokens
the model finds likelier) and the top-N beside it, keyed by token id, first entry None."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.e2e.admin_helpers import PROMPT
from tests.hf_reference import hf_model


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the log_softmax that predicts prompt[1:]."""
    logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("top_n", [0, 3])
def test_prompt_logprobs_equal_hf(client, tiny_llama_dir, top_n):
    answer = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": top_n},
    )  # fmt: skip
    check(answer.choices[0].model_extra["prompt_logprobs"], tiny_llama_dir, top_n)


def test_tokens_route_prompt_logprobs_equal_hf(trainer, tiny_llama_dir):
    """vLLM's /inference/v1/generate carries them at the top (SkyRL's `sample` reads them)."""
    sampling = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    answer = trainer.post(
        "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling}
    )
    check(answer.json()["prompt_logprobs"], tiny_llama_dir, 2)


def check(shown: list, model_dir: str, top_n: int) -> None:
    want = hf_prompt_logprobs(model_dir, PROMPT)
    assert len(shown) == len(PROMPT) and shown[0] is None
    for pos, (entry, lsm) in enumerate(zip(shown[1:], want), start=1):
        token = PROMPT[pos]
        tops = lsm.topk(top_n).indices.tolist() if top_n else []
        assert set(entry) == {str(t) for t in [*tops, token]}
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(lsm[token].item(), abs=1e-4)
        assert own["rank"] == int((lsm > lsm[token]).sum()) + 1
        for rank, t in enumerate(tops, start=1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(lsm[t].item(), abs=1e-4)
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_prompt_logprobs_bad_values_are_400s(client):
    for fields in ({"prompt_logprobs": -1}, {"prompt_logprobs": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=fields)
        assert err.value.body["param"] == "prompt_logprobs"
