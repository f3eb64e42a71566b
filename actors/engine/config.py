"""Engine configuration: one frozen dataclass, named like vLLM's options."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.strict import check_type, strict_fields

DTYPES = ("auto", "float32", "bfloat16", "float16")


@strict_fields
@dataclass(frozen=True)
class EngineConfig:
    """What to load and how much to run at once.

    `num_kv_blocks=None` sizes the KV cache from `kv_cache_memory_gb`; `max_model_len=None` takes
    the model's `max_position_embeddings`.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    enable_return_routed_experts: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    attention_backend: str = "auto"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "device", "attention_backend"):
            check_type("EngineConfig", name, getattr(self, name), str)
        if self.tokenizer is not None:
            check_type("EngineConfig", "tokenizer", self.tokenizer, str)
        for name in ("enable_prefix_caching", "enable_return_routed_experts"):
            check_type("EngineConfig", name, getattr(self, name), bool)
        check_type("EngineConfig", "seed", self.seed, int)
        check_type("EngineConfig", "kv_cache_memory_gb", self.kv_cache_memory_gb, (int, float))
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "max_logprobs"):
            value = getattr(self, name)
            check_type("EngineConfig", name, value, int)
            if value < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {value}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None:
                check_type("EngineConfig", name, value, int)
                if value < 1:
                    raise ValueError(f"EngineConfig.{name} must be >= 1 or None, got {value}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("EngineConfig.kv_cache_memory_gb must be > 0")
        if self.tensor_parallel_size != 1:
            raise ValueError("EngineConfig.tensor_parallel_size > 1 needs the Ray shard group "
                             "(not available in the offline engine yet); use 1")
