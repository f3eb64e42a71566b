"""Which tensor-parallel sizes a model's shapes allow, checked before any process starts.

The rules mirror how layers.py splits a model: query heads, KV heads (split, or replicated
when there are fewer KV heads than ranks) and MLP intermediate sizes are divided across ranks;
the vocabulary is not (vocab-parallel layers pad the last rank). torch-free.
"""

from __future__ import annotations

from typing import Any


def divide_problem(value: int, tp: int, field: str) -> str | None:
    """Why `field`=`value` cannot be split over `tp` ranks, or None when it can."""
    if value % tp == 0:
        return None
    return (
        f"tensor_parallel_size={tp} does not divide {field}={value}; "
        f"pick a tensor_parallel_size that divides {value}"
    )


def kv_heads_problem(kv_heads: int, tp: int) -> str | None:
    """KV heads are split when tp divides them, replicated when tp is a multiple of them."""
    if kv_heads % tp == 0 or (tp > kv_heads and tp % kv_heads == 0):
        return None
    return (
        f"tensor_parallel_size={tp} neither divides num_key_value_heads={kv_heads} nor is "
        f"a multiple of it (KV heads are split or replicated across ranks); pick a "
        f"tensor_parallel_size that divides {kv_heads} or is a multiple of it"
    )


def split_evenly(value: int, tp: int, field: str) -> int:
    """`value // tp`; ValueError naming the field and its divisors when tp does not divide it."""
    problem = divide_problem(value, tp, field)
    if problem:
        raise ValueError(f"{problem} (e.g. {_join(_divisors(value, limit=64))})")
    return value // tp


def split_kv_heads(kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing each KV head); ValueError when neither fits."""
    problem = kv_heads_problem(kv_heads, tp)
    if problem:
        raise ValueError(problem)
    if kv_heads >= tp:
        return kv_heads // tp, 1
    return 1, tp // kv_heads


def check_tp_shape(hf_config: Any, tp: int) -> None:
    """ValueError, naming the field, its value and the size, when `hf_config`'s model cannot
    be split over `tp` tensor-parallel ranks; the message lists the sizes that would work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
    problem = _first_problem(hf_config, tp)
    if problem:
        valid = [
            n
            for n in _divisors(hf_config.num_attention_heads)
            if _first_problem(hf_config, n) is None
        ]
        raise ValueError(f"{problem} (valid for this model: {_join(valid)})")


def _first_problem(config: Any, tp: int) -> str | None:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    problems = [divide_problem(heads, tp, "num_attention_heads"), kv_heads_problem(kv_heads, tp)]
    problems += [divide_problem(value, tp, field) for field, value in _mlp_sizes(config)]
    if "linear_attention" in (getattr(config, "layer_types", None) or []):
        # Gated DeltaNet heads split; gated attention splits its KV heads, never replicates
        fields = ("linear_num_key_heads", "linear_num_value_heads", "num_key_value_heads")
        problems += [divide_problem(getattr(config, f), tp, f) for f in fields]
    return next((p for p in problems if p), None)


def _mlp_sizes(config: Any) -> list[tuple[str, int]]:
    """(field, size) of each MLP kind the model has: dense and/or expert intermediate sizes."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    moe_size = getattr(config, "moe_intermediate_size", None)
    if not experts or moe_size is None:  # dense, or Mixtral (every layer MoE, experts I wide)
        return [("intermediate_size", config.intermediate_size)]
    # Qwen3-MoE: experts moe_intermediate_size wide, dense layers intermediate_size wide
    kinds = {_is_moe_layer(config, i) for i in range(config.num_hidden_layers)}
    sizes = [("moe_intermediate_size", moe_size)] if True in kinds else []
    return sizes + ([("intermediate_size", config.intermediate_size)] if False in kinds else [])


def _is_moe_layer(config: Any, layer_idx: int) -> bool:
    # NOTE: the Qwen3-MoE rule of HF (and of qwen3_moe.is_moe_layer) and DeepSeek's dense
    # first layers (deepseek_v3.is_moe_layer), kept here torch-free
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_idx + 1) % step == 0
        and layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)
    )


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, min(n, limit or n) + 1) if n % d == 0]


def _join(values: list[int]) -> str:
    return ", ".join(map(str, values))
