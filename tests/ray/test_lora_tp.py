"""Multi-LoRA at TP=2 (Ray shards) against TP=1 in process and against PEFT: adapters reach
every rank as a load op between steps, each rank holding its slices (A and B split like their
base layers), and a mixed batch of two adapters and base rows gives the same greedy tokens
(logprobs within 1e-4). An adapter that would not load on the ranks is refused whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from raylane import LoRARequest

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.ray.tp_helpers import ATOL, assert_same_outputs, build, greedy, tp_pair
from tests.tiny_models import make_llama

PROMPTS = [[5, 17, 33, 8, 100, 7], [9, 10, 11, 12], [40, 41, 42], list(range(60, 80))]
NAMES = ["a", None, "b", "b"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_tp")
    return {
        "a": make_adapter(tiny_llama_dir, root / "a", seed=7, r=4),
        "b": make_adapter(tiny_llama_dir, root / "b", seed=8, r=8, use_rslora=True),
    }


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_llama_dir):
    yield from tp_pair(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8)


def test_tp2_equals_tp1_and_peft(pair, adapters, tiny_llama_dir: str, tmp_path: Path) -> None:
    ids = {"a": 1, "b": 2}
    loras = [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in NAMES]
    params = greedy(8, logprobs=2)
    ref = pair.tp1.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    got = pair.tp2.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    assert_same_outputs(got, ref, ATOL)
    peft = peft_models(tiny_llama_dir, adapters)
    for out, name, prompt in zip(got, NAMES, PROMPTS):
        assert out.outputs[0].token_ids == peft_greedy(peft, name, prompt, 8)[0]
    other = make_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="shape"):
        pair.tp2.add_lora(LoRARequest("other", 3, make_adapter(other, tmp_path / "o", r=4)))
    assert sorted(i.name for i in pair.tp2.list_loras()) == ["a", "b"]


def test_update_reaches_every_rank(pair, adapters) -> None:
    tensors = {}
    for engine in (pair.tp1, pair.tp2):
        named = engine.loras.weights("a").named_tensors()
        tensors = {n: -t if "lora_B" in n else t for n, t in named.items()}
        assert engine.update_lora("a", tensors.items()) == 2
    params = greedy(8, logprobs=2)
    lora = LoRARequest("a", 1)
    ref = pair.tp1.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    got = pair.tp2.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    assert_same_outputs(got, ref, ATOL)
    assert all(o.outputs[0].lora_versions == [2] * 8 for o in got)


def test_ray_executor_at_tp1(ray_cluster, tiny_llama_dir, adapters) -> None:
    engine = build(tiny_llama_dir, distributed_executor_backend="ray", enable_lora=True)
    try:
        lora = LoRARequest("a", 1, adapters["a"])
        out = engine.generate([PROMPTS[0]], greedy(8), use_tqdm=False, lora_request=lora)[0]
    finally:
        engine.shutdown()
    peft = peft_models(tiny_llama_dir, adapters)
    assert out.outputs[0].token_ids == peft_greedy(peft, "a", PROMPTS[0], 8)[0]
