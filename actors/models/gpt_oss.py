"""gpt-oss: sliding-window and full attention layers alternating, learned attention sinks on
every layer, q/k/v/o biases, YaRN RoPE, and a top-k MoE on every layer (softmax over the k
chosen logits; experts with biases and a clamped SwiGLU) with routed-expert capture.

The checkpoint's experts are fused 3-D tensors with gate and up columns interleaved
(`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]); they load into the [gate | up] row layout
of `FusedMoE`-style weights, split by intermediate size under TP.

Its RMSNorms apply the weight in float32 before the cast back (transformers' GptOssRMSNorm),
not after it as Llama's do: `RMSNorm(weight_first=True)`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
from raylane.actors.models.attention import Attention
from raylane.actors.models.checkpoint import materialize
from raylane.actors.models.layers import (
    Loaded,
    ReplicatedLinear,
    TPGroup,
    copy_checked,
    divide,
    new_param,
    split_rows,
)
from raylane.actors.models.llama import (
    AttentionSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from raylane.kernels.activation import clamped_swiglu
from raylane.kernels.moe import expert_forward, select_experts_topk_softmax
from raylane.kernels.norm import RMSNorm
from torch import nn

SLIDING, FULL = "sliding_attention", "full_attention"


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases, a window on sliding layers and per-head sinks."""

    def __init__(self, spec: AttentionSpec, window: int | None, tp: TPGroup) -> None:
        super().__init__(spec, tp)
        self.tp = tp
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, spec.head_dim, spec.head_dim**-0.5, window, True
        )
        assert self.attn.sinks is not None
        setattr(self.attn.sinks, "weight_loader", self.load_sinks)

    def load_sinks(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
        n = self.num_heads  # this rank's heads
        src = split_rows(loaded, 0, n * self.tp.world_size, self.tp.rank, n, "sinks")
        copy_checked(param.data, src, "self_attn.sinks")


class GptOssExperts(nn.Module):
    """w13 [E, 2 * I_local, H] (gate rows then up rows), w2 [E, H, I_local], biases b13
    [E, 2 * I_local] and b2 [E, H] (whole on rank 0, zero elsewhere: added once by the
    all-reduce)."""

    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def __init__(self, config: Any, tp: TPGroup) -> None:
        super().__init__()
        self.tp, e, h = tp, config.num_local_experts, config.hidden_size
        self.local = divide(config.intermediate_size, tp.world_size, "intermediate_size")
        self.w13_weight = new_param((e, 2 * self.local, h), self.weight_loader)
        self.w2_weight = new_param((e, h, self.local), self.weight_loader)
        self.b13 = new_param((e, 2 * self.local), self.weight_loader)
        self.b2 = new_param((e, h), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, part: Any = None) -> None:
        t, n, rank = materialize(loaded), self.local, self.tp.rank
        if part == "down":  # [E, I, H] -> [E, H, I], this rank's I columns
            src = t.transpose(1, 2).narrow(2, rank * n, n)
        elif part == "down_bias":
            src = t if rank == 0 else torch.zeros_like(t)
        else:  # gate_up [E, H, 2I] or its bias [E, 2I], gate and up interleaved along 2I
            if part == "gate_up":
                t = t.transpose(1, 2)  # [E, 2I, H]
            gate, up = t[:, 0::2], t[:, 1::2]
            src = torch.cat([gate.narrow(1, rank * n, n), up.narrow(1, rank * n, n)], dim=1)
        copy_checked(param.data, src, f"experts.{part}")


class GptOssMoE(nn.Module):
    def __init__(self, config: Any, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.top_k = tp, config.num_experts_per_tok
        self.router = ReplicatedLinear(
            config.hidden_size, config.num_local_experts, bias=True, tp=tp
        )
        self.experts = GptOssExperts(config, tp)
        # transformers before these were config fields (5.17) hard-coded gpt-oss's 1.702 and 7.0
        alpha = getattr(config, "swiglu_alpha", 1.702)
        self.act = partial(clamped_swiglu, alpha=alpha, limit=getattr(config, "swiglu_limit", 7.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], expert ids [T, top_k] int32)."""
        weights, ids = select_experts_topk_softmax(self.router(x), self.top_k)
        ex = self.experts
        out = expert_forward(
            x,
            ex.w13_weight,
            ex.w2_weight,
            weights,
            ids,
            b13=ex.b13,
            b2=ex.b2,
            act=self.act,
            invariant=ex.invariant,
        )
        return self.tp.all_reduce(out), ids.to(torch.int32)


class GptOssForCausalLM(LlamaForCausalLM):
    weight_renames: ClassVar[list[tuple[str, str]]] = [("self_attn.sinks", "self_attn.attn.sinks")]

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        unknown = set(config.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)}; known: {SLIDING}, {FULL}")
        super().__init__(config, tp)
        self.model.norm = _norm(config)
        self.num_moe_layers = config.num_hidden_layers
        self.moe_top_k = config.num_experts_per_tok

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        return AttentionSpec.from_config(config, sliding_ok=True)

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        sliding = config.layer_types[layer_idx] == SLIDING
        attn = GptOssAttention(spec, config.sliding_window if sliding else None, self.tp)
        moe = GptOssMoE(config, self.tp)
        layer = LlamaDecoderLayer(spec, moe, is_moe=True, tp=self.tp, self_attn=attn)
        layer.input_layernorm, layer.post_attention_layernorm = _norm(config), _norm(config)
        return layer

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        # the bias names first: "gate_up_proj" is a prefix of "gate_up_proj_bias"
        return [
            ("experts.b13", "experts.gate_up_proj_bias", "gate_up_bias"),
            ("experts.b2", "experts.down_proj_bias", "down_bias"),
            ("experts.w13_weight", "experts.gate_up_proj", "gate_up"),
            ("experts.w2_weight", "experts.down_proj", "down"),
        ]


def _norm(config: Any) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, weight_first=True)
