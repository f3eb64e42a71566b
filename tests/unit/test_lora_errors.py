"""Bad LoRA input is refused with the error that names it, and nothing is loaded or changed:
a rank above max_lora_rank, modules the model lacks, shapes of another base model, missing or
corrupt files, more pinned adapters than slots, unloading with requests in flight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from raylane.actors.lora import LoRAInUse, LoRANotFound, LoRASlotsFull
from safetensors.torch import save_file

from tests.lora_adapters import make_adapter
from tests.tiny_models import make_llama, make_qwen3_moe

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_errors")


@pytest.fixture(scope="module")
def base(root: Path) -> str:
    return make_llama(root / "base")


@pytest.fixture(scope="module")
def engine(base: str):
    engine = LLMEngine(
        EngineConfig(model=base, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=4)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def good(base: str, root: Path) -> str:
    return make_adapter(base, root / "good", seed=1, r=4)


def _unchanged(engine: LLMEngine, names: list[str]) -> None:
    assert [i.name for i in engine.list_loras()] == names


def test_bad_adapters_load_nothing(engine: LLMEngine, base: str, root: Path, good: str) -> None:
    wide = make_adapter(base, root / "r16", r=16)
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.add_lora(LoRARequest("wide", 1, wide))
    deeper = make_llama(root / "deeper", num_hidden_layers=3)  # layer 2 is not in the base
    with pytest.raises(ValueError, match="target_modules.*layers.2"):
        engine.add_lora(LoRARequest("deep", 2, make_adapter(deeper, root / "deep", r=4)))
    other = make_llama(root / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="shape"):
        engine.add_lora(LoRARequest("other", 3, make_adapter(other, root / "o", r=4)))
    with pytest.raises(ValueError, match="lora_path"):
        engine.add_lora(LoRARequest("missing", 4, str(root / "nowhere")))
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        engine.add_lora(LoRARequest("corrupt", 5, str(corrupt)))
    with pytest.raises(ValueError, match="lora_path"):  # a request naming a bad adapter
        engine.generate([[1, 2, 3]], PARAMS, False, LoRARequest("missing", 4, "/nowhere"))
    _unchanged(engine, [])
    assert not engine.has_unfinished_requests()
    assert engine.add_lora(LoRARequest("good", 6, good))
    _unchanged(engine, ["good"])
    engine.remove_lora("good")


def test_moe_experts_are_not_targets(root: Path) -> None:
    moe = make_qwen3_moe(root / "moe")
    adapter = root / "moe_mlp"  # written by hand: PEFT cannot target transformers' fused experts
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]})
    )
    prefix = "base_model.model.model.layers.1.mlp.gate_proj"  # an MoE layer
    tensors = {f"{prefix}.lora_A.weight": torch.ones(4, 64)}
    tensors[f"{prefix}.lora_B.weight"] = torch.ones(32, 4)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    engine = LLMEngine(EngineConfig(model=moe, enable_lora=True))
    try:
        with pytest.raises(ValueError, match="target_modules"):
            engine.add_lora(LoRARequest("mlp", 1, str(adapter)))
        _unchanged(engine, [])
    finally:
        engine.shutdown()


def test_slots_full_and_in_use(engine: LLMEngine, good: str) -> None:
    assert engine.add_lora(LoRARequest("a", 1, good), pinned=True)
    with pytest.raises(LoRASlotsFull):  # the only slot is pinned
        engine.add_lora(LoRARequest("b", 2, good), pinned=True)
    _unchanged(engine, ["a"])
    engine.add_lora(LoRARequest("b", 2, good))
    with pytest.raises(LoRASlotsFull):
        engine.generate([[1, 2, 3]], PARAMS, False, LoRARequest("b", 2))
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [1, 2, 3], PARAMS, lora_request=LoRARequest("a", 1))
    engine.step()
    with pytest.raises(LoRAInUse):
        engine.remove_lora("a", wait=False)
    _unchanged(engine, ["a", "b"])
    assert engine.remove_lora("a")  # its request runs on; new ones are refused
    with pytest.raises(LoRANotFound):
        engine.add_request("s", [1, 2, 3], PARAMS, lora_request=LoRARequest("a", 1))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].finish_reason == "length"
    _unchanged(engine, ["b"])
    out = engine.generate([[1, 2, 3]], PARAMS, False, LoRARequest("b", 2))[0]  # the slot is free
    assert out.outputs[0].lora_versions == [1] * 4


def test_lora_off(base: str) -> None:
    engine = LLMEngine(EngineConfig(model=base))
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            engine.generate([[1, 2]], PARAMS, False, LoRARequest("a", 1, "/x"))
        with pytest.raises(ValueError, match="lora_request"):
            engine.generate([[1, 2]], PARAMS, False, "adapter")  # type: ignore[arg-type]
    finally:
        engine.shutdown()
