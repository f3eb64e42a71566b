"""Reading PEFT adapter directories: what is served, and every refusal names its field. The
adapters are PEFT's own (`save_pretrained`); expected values come from their config files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from raylane import LoRARequest
from raylane.actors.engine import EngineConfig
from raylane.actors.lora.adapter import load_adapter, replace_tensors
from safetensors.torch import load_file

from tests.lora_adapters import make_adapter
from tests.tiny_models import make_llama


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_llama(tmp_path_factory.mktemp("lora_base"))


@pytest.fixture(scope="module")
def adapter(base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_adapter(base, tmp_path_factory.mktemp("a") / "ad", r=4, lora_alpha=16)


def _edit(src: str, dst: Path, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def test_reads_peft_dir(adapter: str) -> None:
    weights = load_adapter(adapter, max_rank=16)
    raw = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    assert weights.rank == config["r"] == 4
    assert weights.scaling == config["lora_alpha"] / config["r"]
    assert len(weights.modules) * 2 == len(raw)
    for name, tensor in weights.named_tensors().items():
        assert torch.equal(tensor, raw[name])


def test_rslora_scaling(base: str, tmp_path: Path) -> None:
    path = make_adapter(base, tmp_path / "rs", r=8, lora_alpha=4, use_rslora=True)
    assert load_adapter(path, 16).scaling == pytest.approx(4 / math.sqrt(8))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"bias": "all"}, "bias"),
        ({"use_dora": True}, "use_dora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"r": 0}, "r"),
        ({"lora_alpha": "x"}, "lora_alpha"),
    ],
)
def test_refuses_config_fields(adapter: str, tmp_path: Path, fields: dict, named: str) -> None:
    path = _edit(adapter, tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match=named):
        load_adapter(path, 16)


def test_rank_above_max(adapter: str) -> None:
    with pytest.raises(ValueError, match=r"r: .*rank 4 exceeds EngineConfig.max_lora_rank 2"):
        load_adapter(adapter, max_rank=2)


def test_missing_and_corrupt_files(adapter: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_path"):
        load_adapter(str(tmp_path / "nowhere"), 16)
    no_weights = Path(_edit(adapter, tmp_path / "nw"))
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_adapter(str(no_weights), 16)
    corrupt = Path(_edit(adapter, tmp_path / "cor"))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00not safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_adapter(str(corrupt), 16)
    bad_json = Path(_edit(adapter, tmp_path / "js"))
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_adapter(str(bad_json), 16)


def test_replace_tensors_checks_names_and_shapes(adapter: str) -> None:
    old = load_adapter(adapter, 16)
    name, tensor = next(iter(old.named_tensors().items()))
    new = replace_tensors(old, [(name, torch.ones_like(tensor))])
    assert torch.equal(new.named_tensors()[name], torch.ones_like(tensor))
    assert not torch.equal(old.named_tensors()[name], new.named_tensors()[name])
    with pytest.raises(ValueError, match="not a tensor of the adapter"):
        replace_tensors(old, [("base_model.model.lm_head.lora_A.weight", tensor)])
    with pytest.raises(ValueError, match="shape"):
        replace_tensors(old, [(name, torch.ones(1, 1))])


def test_lora_request_and_config_fields() -> None:
    request = LoRARequest("a", 1, "/p")
    assert (request.name, request.adapter_id, request.path) == ("a", 1, "/p")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(model="m", enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    for method in ("mtp", "draft_model"):
        spec = {"method": method, "num_speculative_tokens": 2}
        if method == "draft_model":
            spec["model"] = "m"
        with pytest.raises(ValueError, match="does not run LoRA"):
            EngineConfig(model="m", enable_lora=True, speculative_config=spec)
