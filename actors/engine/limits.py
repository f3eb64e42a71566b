"""What an engine accepts for a model: the context length, the vocabulary, whether it routes
tokens to experts. The engine derives its own limits here, and the ingress asks the same function
rather than repeating the rule."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.actors.engine.config import EngineConfig

# what a config without max_position_embeddings gets (vLLM's fallback too)
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int  # prompt + output tokens per sequence
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)
    is_moe: bool  # routes tokens to experts, so routed experts can be returned
    is_dsa: bool = False  # sparse attention (an indexer), so indexer top-k can be returned


def model_limits(hf_config, config: EngineConfig) -> ModelLimits:
    """The limits an engine built from `config` enforces on the model `hf_config` describes."""
    max_len = config.max_model_len
    if max_len is None:
        max_len = int(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
    is_moe = bool(getattr(hf_config, "num_experts_per_tok", 0))  # Qwen3-MoE, Mixtral
    is_dsa = bool(getattr(hf_config, "index_topk", 0))  # DeepSeek-V3.2
    return ModelLimits(max_len, hf_config.vocab_size, is_moe, is_dsa)


def read_model_limits(config: EngineConfig) -> ModelLimits:
    """`model_limits` for `config.model`, read from its directory (a .gguf converts once)."""
    from raylane.actors.models.loader import resolve_model_dir
    from transformers import AutoConfig

    return model_limits(AutoConfig.from_pretrained(resolve_model_dir(config.model)), config)
