"""A model's layer kinds read from its HF config (`layer_types`), as `ModelLayout` data: what
each layer keeps per sequence, for memory accounting (start-up sizing, `python -m benchmarks
hybrid`).

Paged layers cost K and V of `num_key_value_heads * head_dim` each per token; a linear-attention
(Gated DeltaNet) layer a conv state [2 * Hk * Dk + Hv * Dv, W - 1] in the model's dtype plus a
float32 recurrent state [Hv, Dk, Dv].
"""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.layer_kinds import KVGroups, LayerKind, ModelLayout, kv_groups

FLOAT32_BYTES = 4


def model_layout(config: Any, dtype_bytes: int) -> ModelLayout:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_key_value_heads * head_dim * dtype_bytes
    layers = []
    for kind in types:
        if kind == "linear_attention":
            layers.append(LayerKind("linear", state_bytes=_linear_state_bytes(config, dtype_bytes)))
        elif kind == "sliding_attention":
            layers.append(LayerKind("sliding", kv_bytes, window=config.sliding_window))
        elif kind == "full_attention":
            layers.append(LayerKind("full", kv_bytes))
        else:
            raise ValueError(f"layer_types: unknown {kind!r}")
    return ModelLayout(tuple(layers))


def layer_groups(attention_layers: list[Any]) -> KVGroups:
    """A built model's paged layers in KV cache groups, by each layer's own `window` (read
    from the layers, so a layer the model runs in full never loses KV). Layers whose cache
    rows differ in shape cannot share tensors: such a mix stays one group that frees nothing."""
    windows = [getattr(layer, "window", None) for layer in attention_layers]
    shapes = {tuple(layer.cache_shapes()) for layer in attention_layers}
    if len(shapes) > 1 and len(set(windows)) > 1:
        return kv_groups([None] * len(windows))
    return kv_groups(windows)


def full_attention_layout(config: Any, dtype_bytes: int) -> ModelLayout:
    """The same model with every layer a full-attention layer of its attention shape."""
    full = model_layout(config, dtype_bytes).layers
    kv = next(layer.kv_bytes_per_token for layer in full if layer.kind != "linear")
    return ModelLayout(tuple(LayerKind("full", kv) for _ in full))


def _linear_state_bytes(config: Any, dtype_bytes: int) -> int:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    return conv + hv * dk * dv * FLOAT32_BYTES
