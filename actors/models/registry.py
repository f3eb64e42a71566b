"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module, class); imported lazily so a lookup never builds torch modules
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("raylane.actors.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("raylane.actors.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("raylane.actors.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("raylane.actors.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("raylane.actors.models.qwen3_moe", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("raylane.actors.models.deepseek_v3", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("raylane.actors.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("raylane.actors.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("raylane.actors.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "Glm4MoeForCausalLM": ("raylane.actors.models.deepseek_v3", "Glm4MoeForCausalLM"),
    "Gemma3ForCausalLM": ("raylane.actors.models.gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("raylane.actors.models.gpt_oss", "GptOssForCausalLM"),
    "Qwen3_5ForCausalLM": ("raylane.actors.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("raylane.actors.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("raylane.actors.models.qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: Any) -> type:
    """The class for an HF config (or an architecture name); ValueError if unsupported."""
    archs = (
        [config] if isinstance(config, str) else list(getattr(config, "architectures", None) or [])
    )
    if not archs:
        raise ValueError(
            "architectures: config.json names no architecture; "
            f"supported: {supported_architectures()}"
        )
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"architectures: {archs} not supported; supported: {supported_architectures()}"
    )
