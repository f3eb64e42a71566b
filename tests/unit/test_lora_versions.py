"""Adapter versions: a request keeps the version it started on, updates (one call or bucketed)
make new versions, the prefix cache never shares KV across adapters or versions (a warm run
equals a cold one), and an old version no request holds is gone. References: PeftModel over
PEFT directories holding each version's tensors."""

from __future__ import annotations

import pytest
import torch
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from raylane.actors.lora import LoRAVersionGone
from raylane.actors.models.weights import TensorSpec, encode_bucket

from tests.lora_adapters import make_adapter, peft_greedy, peft_models, rewritten
from tests.tiny_models import make_llama

PROMPT = list(range(20, 60))  # 40 tokens: 2 full blocks of 16
N = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_versions")
    base = make_llama(root / "base")
    v1 = make_adapter(base, root / "v1", seed=3, r=4)
    v2, update = rewritten(v1, root / "v2", lambda n, t: -t if "lora_B" in n else t)
    ref = peft_models(base, {"v1": v1, "v2": v2})
    expected = {name: peft_greedy(ref, name, PROMPT, N)[0] for name in ("v1", "v2", None)}
    assert len(set(map(tuple, expected.values()))) == 3  # three different answers
    return base, v1, update, expected


def _engine(base: str, **options) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8, **options)
    )


def _run(engine: LLMEngine, lora: LoRARequest | None):
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N), False, lora)[0]
    return out.outputs[0], out.num_cached_tokens


def test_prefix_cache_by_adapter_and_version(setup) -> None:
    base, v1, update, expected = setup
    engine = _engine(base)
    try:
        a = LoRARequest("a", 1, v1)
        cold, cached = _run(engine, a)
        warm, warm_cached = _run(engine, a)
        assert cold.token_ids == warm.token_ids == expected["v1"]
        assert (cached, warm_cached) == (0, 32)
        plain, plain_cached = _run(engine, None)  # the same prompt, no adapter: no reuse
        assert (plain.token_ids, plain_cached, plain.lora_versions) == (expected[None], 0, None)
        engine.add_lora(LoRARequest("b", 2, v1))  # the same tensors, another adapter
        assert _run(engine, LoRARequest("b", 2))[1] == 0
        assert engine.update_lora("a", update.items()) == 2
        new, new_cached = _run(engine, LoRARequest("a", 1))
        assert (new.token_ids, new_cached, new.lora_versions) == (expected["v2"], 0, [2] * N)
        assert _run(engine, LoRARequest("a", 1))[1] == 32  # version 2's own blocks
    finally:
        engine.shutdown()


def test_request_keeps_its_version(setup) -> None:
    base, v1, update, expected = setup
    engine = _engine(base, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=N)
    try:
        engine.add_lora(LoRARequest("a", 1, v1), pinned=True)
        engine.add_request("old", PROMPT, params, lora_request=LoRARequest("a", 1))
        engine.step()
        engine.step()  # "old" is decoding on version 1
        assert engine.update_lora("a", update.items(), version="step-9") == 2
        engine.add_request("new", PROMPT, params, lora_request=LoRARequest("a", 1))
        held = LoRARequest("a", 1, version=1)  # still held: "old" runs on it
        engine.add_request("held", PROMPT, params, lora_request=held)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        info = engine.list_loras()[0]
        assert (info.version, info.version_label, info.pinned, info.loaded) == (
            2,
            "step-9",
            True,
            True,
        )
    finally:
        engine.shutdown()
    assert (done["old"].token_ids, done["old"].lora_versions) == (expected["v1"], [1] * N)
    assert (done["held"].token_ids, done["held"].lora_versions) == (expected["v1"], [1] * N)
    assert (done["new"].token_ids, done["new"].lora_versions) == (expected["v2"], [2] * N)
    with pytest.raises(LoRAVersionGone):  # no request holds version 1 any more
        engine.add_request("late", PROMPT, params, lora_request=held)


def test_bucketed_update_and_failed_update(setup) -> None:
    base, v1, update, expected = setup
    engine = _engine(base)
    try:
        engine.add_lora(LoRARequest("a", 1, v1))
        names = sorted(update)
        bad = {names[0]: torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="shape"):
            engine.update_lora("a", bad.items())
        assert engine.list_loras()[0].version == 1  # the old version stays
        assert _run(engine, LoRARequest("a", 1))[0].token_ids == expected["v1"]
        engine.begin_lora_update("a", [TensorSpec.of(n, update[n]) for n in names])
        half = len(names) // 2
        engine.load_lora_bucket(encode_bucket([(n, update[n]) for n in names[:half]]))
        engine.load_lora_bucket({n: update[n] for n in names[half:]})
        assert engine.finish_lora_update(7) == 7
        out = _run(engine, LoRARequest("a", 1))[0]
        assert (out.token_ids, out.lora_versions) == (expected["v2"], [7] * N)
        with pytest.raises(ValueError, match="not a tensor of adapter"):
            engine.begin_lora_update(
                "a", [TensorSpec("base_model.model.x.lora_A.weight", (1,), "float32")]
            )
    finally:
        engine.shutdown()
