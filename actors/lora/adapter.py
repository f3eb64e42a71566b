"""A LoRA adapter's tensors, read from a PEFT directory (or given by an update) and checked
against its config: `LoRAWeights`, plain picklable data that travels to every rank."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from raylane.actors.lora.peft_config import PeftLoRAConfig, read_peft_config

# PEFT's saved names: base_model.model.<module path>.lora_A.weight / lora_B.weight
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
SAFETENSORS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter version: module path (HF's, e.g. "model.layers.0.self_attn.q_proj") ->
    (A [r, in], B [out, r]), and the scaling PEFT applies to B @ A."""

    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The PEFT names, as adapter_model.safetensors holds them."""
        out = {}
        for module, (a, b) in self.modules.items():
            out[peft_name(module, "A")] = a
            out[peft_name(module, "B")] = b
        return out


def peft_name(module: str, ab: str) -> str:
    return f"base_model.model.{module}.lora_{ab}.weight"


def load_adapter(directory: str, max_rank: int) -> LoRAWeights:
    """Read and check a PEFT directory (ValueError naming the field, file or tensor)."""
    if not directory:
        raise ValueError("lora_path: empty, and no adapter of that name is registered")
    if not Path(directory).is_dir():
        raise ValueError(f"lora_path: {directory!r} is not a directory")
    config = read_peft_config(directory)
    return build_weights(config, _read_tensors(Path(directory) / SAFETENSORS), max_rank)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"lora_path: no {SAFETENSORS} in {str(path.parent)!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"{SAFETENSORS}: not a readable safetensors file ({e})") from None


def build_weights(
    config: PeftLoRAConfig, tensors: dict[str, torch.Tensor], max_rank: int
) -> LoRAWeights:
    if config.rank > max_rank:
        raise ValueError(
            f"r: the adapter's rank {config.rank} exceeds EngineConfig.max_lora_rank {max_rank}"
        )
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"adapter tensor {name!r}: not a LoRA A/B weight raylane serves")
        module = match["module"]
        if module.rsplit(".", 1)[-1] not in config.target_modules:
            raise ValueError(
                f"target_modules: tensor {name!r} is for a module outside {config.target_modules}"
            )
        parts.setdefault(module, {})[match["ab"]] = tensor
    if not parts:
        raise ValueError(f"{SAFETENSORS}: holds no LoRA tensors")
    return LoRAWeights(config.rank, config.scaling, _pairs(parts, config.rank))


def _pairs(
    parts: dict[str, dict[str, torch.Tensor]], rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    modules = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ValueError(f"adapter tensor {peft_name(module, missing)!r}: missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"adapter tensors of {module!r}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} "
                f"do not fit rank r={rank} (A [r, in], B [out, r])"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"adapter tensors of {module!r}: must be floating point")
        modules[module] = (a, b)
    return modules


def replace_tensors(
    old: LoRAWeights, named: Iterable[tuple[str, torch.Tensor]], scaling: float | None = None
) -> LoRAWeights:
    """A new version: `old` with the given PEFT-named tensors replaced (each must be one of
    the adapter's, same shape; ValueError naming it otherwise)."""
    current = old.named_tensors()
    for name, tensor in named:
        if name not in current:
            raise ValueError(f"update_lora: {name!r} is not a tensor of the adapter")
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise ValueError(
                f"update_lora: {name!r} has shape {tuple(tensor.shape)}, "
                f"the adapter's is {tuple(current[name].shape)}"
            )
        current[name] = tensor.detach().clone()
    config = PeftLoRAConfig(old.rank, 0.0, False, tuple(_targets_of(old)))
    weights = build_weights(config, current, old.rank)
    return LoRAWeights(old.rank, old.scaling if scaling is None else scaling, weights.modules)


def _targets_of(weights: LoRAWeights) -> set[str]:
    return {module.rsplit(".", 1)[-1] for module in weights.modules}
