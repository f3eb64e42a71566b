"""Llama-family decoders: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

One parametrised implementation; the variants differ only in `AttentionSpec` fields. Qwen3-MoE
reuses everything here and swaps the MLP (see qwen3_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from raylane.actors.models.attention import Attention
from raylane.actors.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from raylane.kernels.activation import SiluAndMul
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.norm import RMSNorm
from raylane.kernels.rotary import Rotary, RotaryEmbedding, rope_parameters_of
from torch import nn


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape and options of one model, read once from its HF config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(hash=False)  # partial_rotary_factor taken out
    max_position_embeddings: int
    rotary_dim: int = 0  # the leading dims of each head that RoPE rotates; 0: all of them

    @classmethod
    def from_config(
        cls,
        config: Any,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        sliding_ok: bool = False,
    ) -> AttentionSpec:
        """`sliding_ok`: the model builds its sliding-window layers itself."""
        if not sliding_ok and "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("layer_types: sliding-window attention layers are not supported")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(
                f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
            )
        bias = bool(getattr(config, "attention_bias", False))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = rope_parameters_of(config)
        partial = rope.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return cls(
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            qkv_bias=bias if qkv_bias is None else qkv_bias,
            o_bias=bias if o_bias is None else o_bias,
            qk_norm=qk_norm,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=config.max_position_embeddings,
            rotary_dim=int(head_dim * (partial or 1.0)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias, tp
        )
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, spec.head_dim, spec.head_dim**-0.5)
        self.rotary = Rotary()

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        t, d, h, kvh = hidden.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, KVH, D]
        if self.q_norm is None or self.k_norm is None:  # rotate q, k heads at once: [T, H + KVH, D]
            qk = self.rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]  # NOTE: views, row stride (H + KVH) * D
        else:
            q = self.q_norm(qkv[:, : h * d].view(t, h, d))
            k = self.k_norm(qkv[:, h * d : (h + kvh) * d].view(t, kvh, d))
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = self.attn(q, k, v, attn)  # [T, H, D]
        return self.o_proj(out.reshape(t, h * d))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, tp
        )
        self.act_fn = SiluAndMul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. `mlp` returns a tensor, or (tensor, expert ids) when `is_moe`.
    `self_attn`: another attention module with LlamaAttention's forward (e.g. DeepSeek's MLA)."""

    def __init__(
        self,
        spec: AttentionSpec,
        mlp: nn.Module,
        is_moe: bool,
        tp: TPGroup | None = None,
        self_attn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(spec, tp)
        self.mlp, self.is_moe = mlp, is_moe
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.is_moe:
            hidden, expert_ids = self.mlp(hidden)
            return hidden, residual, expert_ids
        return self.mlp(hidden), residual, None


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: AttentionSpec,
        layers: list[LlamaDecoderLayer],
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            spec.rotary_dim or spec.head_dim,
            spec.rope_parameters,
            spec.max_position_embeddings,
            dtype=torch.get_default_dtype(),
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary_emb(positions)  # [T, rotary_dim] each, shared by all layers
        residual, routed = None, []
        for layer in self.layers:
            hidden, residual, expert_ids = layer(hidden, residual, cos, sin, attn)
            if expert_ids is not None:
                routed.append(expert_ids)
        hidden, _ = self.norm(hidden, residual)
        return hidden, (torch.stack(routed, dim=1) if routed else None)  # [T, L_moe, k] int32


class LlamaForCausalLM(nn.Module):
    """Llama: q/k/v/o bias from `attention_bias`, no q/k norm."""

    # fused param -> the checkpoint names it is stacked from, with their shard ids
    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    weight_renames: ClassVar[list[tuple[str, str]]] = []  # checkpoint name fragment -> ours
    num_moe_layers = 0
    moe_top_k = 0

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.tp = config, tp or TPGroup()
        spec = self.attention_spec(config)
        layers = [self.make_layer(config, spec, i) for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, spec, layers, self.tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        return AttentionSpec.from_config(config)

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bool(getattr(config, "mlp_bias", False)),
            self.tp,
        )
        return LlamaDecoderLayer(spec, mlp, is_moe=False, tp=self.tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids / positions [T] int64 -> (hidden [T, D] after the final norm, routed
        expert ids [T, num_moe_layers, top_k] int32 or None for dense models)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # [N, vocab] float32

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.layers.modules() if isinstance(m, Attention)]  # layer order

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        """(our param fragment, checkpoint fragment, shard id) for expert weights; none here."""
        return []


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v, none on o."""

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        return AttentionSpec.from_config(config, qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before RoPE."""

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        return AttentionSpec.from_config(config, qk_norm=True)
