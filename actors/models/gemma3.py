"""Gemma 3 (text): sliding-window and full attention layers (five to one by default), each kind
with its own RoPE base; q/k RMSNorm, "sandwich" norms around attention and MLP, Gemma's
(1 + w) RMSNorm, embeddings scaled by sqrt(hidden), logits optionally soft-capped.

Sliding layers are `Attention` layers with a window, so their kind is "sliding" and the backend
masks keys outside the window.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.attention import Attention
from raylane.actors.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from raylane.actors.models.llama import AttentionSpec, LlamaForCausalLM, LlamaMLP
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.norm import GemmaRMSNorm
from raylane.kernels.rotary import Rotary, RotaryEmbedding
from torch import nn

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_spec(config: Any) -> AttentionSpec:
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        qkv_bias=bool(config.attention_bias),
        o_bias=bool(config.attention_bias),
        qk_norm=True,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={},  # per layer type, see Gemma3Model
        max_position_embeddings=config.max_position_embeddings,
    )


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, spec: AttentionSpec, layer_type: str, tp: TPGroup) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping: attention soft-capping is not supported")
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, h, kvh, spec.qkv_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.layer_type = d, layer_type
        self.o_proj = RowParallelLinear(h * d, spec.hidden_size, spec.o_bias, tp)
        self.q_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        window = config.sliding_window if layer_type == SLIDING else None
        scale = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale, window=window)
        self.rotary = Rotary()

    def forward(self, hidden, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], attn):
        t, d, h, kvh = hidden.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        cos, sin = rope[self.layer_type]
        q = self.rotary(self.q_norm(qkv[:, : h * d].view(t, h, d)), cos, sin)
        k = self.rotary(self.k_norm(qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)), cos, sin)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        return self.o_proj(self.attn(q, k, v, attn).reshape(t, h * d))


class Gemma3DecoderLayer(nn.Module):
    """Norms on both sides of attention and of the MLP; the residual adds the normed output."""

    def __init__(self, config: Any, spec: AttentionSpec, layer_type: str, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, spec, layer_type, tp)
        act = config.hidden_activation
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, act, False, tp)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, hidden, rope, attn: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, attn)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, spec: AttentionSpec, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, spec, kind, tp) for kind in config.layer_types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    spec.head_dim,
                    dict(config.rope_parameters[kind]),
                    spec.max_position_embeddings,
                    dtype=torch.get_default_dtype(),
                )
                for kind in sorted(set(config.layer_types))
            }
        )

    def forward(self, input_ids, positions, attn: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)  # [T, D]
        # HF rounds the scale to the weights' dtype before multiplying
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rope = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden = layer(hidden, rope, attn)
        return self.norm(hidden), None


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (`Gemma3ForCausalLM`, model type gemma3_text)."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        self.config, self.tp = config, tp or TPGroup()
        unknown = set(config.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)}; known: {SLIDING}, {FULL}")
        # Llama's loading and forward, Gemma's modules
        self.model = Gemma3Model(config, gemma_spec(config), self.tp)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.layers.modules() if isinstance(m, Attention)]
