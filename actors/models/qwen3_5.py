"""Qwen3.5 (text): Gated DeltaNet linear-attention layers and gated full-attention layers
(three to one by default), a dense gated MLP, zero-centred (1 + w) RMSNorms.

A linear-attention layer keeps no paged K/V: per sequence, a causal-conv state [C, W - 1] and a
recurrent state [Hv, Dk, Dv] (float32), in rows of fixed pools the runner attaches
(`state_shapes`, `attach_state`); the step's `AttentionMetadata.linear` says which row each
sequence uses. A full-attention layer gates its output with sigmoid(gate), the gate projected
with the query. Tensor parallelism splits both by heads: a rank keeps its key and value heads
of every linear layer (projections, conv channels, decay parameters, and so its slice of the
recurrent state) and its query / KV heads of the attention layers; out_proj and o_proj reduce.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from raylane.actors.models.attention import Attention
from raylane.actors.models.head_split import PartsColumnParallelLinear, parts_loader
from raylane.actors.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from raylane.actors.models.llama import (
    AttentionSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from raylane.actors.models.mtp import MtpHost
from raylane.actors.models.qwen3_moe import SparseMoeBlock, expert_mapping
from raylane.actors.models.qwen_mtp import QwenMtp, qwen_mtp_name
from raylane.actors.models.tp_shape import split_evenly
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.elementwise import rowwise, silu
from raylane.kernels.batch_invariant.elementwise import sigmoid as invariant_sigmoid
from raylane.kernels.batch_invariant.triton_gdn_norms import (
    gated_rms_norm as invariant_gated_rms_norm,
)
from raylane.kernels.linear_attention import LinearAttentionBackend, get_linear_backend
from raylane.kernels.linear_attention.verify import verify_conv, verify_delta_rule
from raylane.kernels.norm import GemmaRMSNorm
from raylane.kernels.rotary import Rotary
from torch import nn

LINEAR, FULL = "linear_attention", "full_attention"


def gated_rms_norm(x, gate, weight, eps: float, invariant: bool = False) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate), as HF's Qwen3_5RMSNormGated: x, gate [..., D];
    `invariant`: the SiLU row by row on the vector path (the batch-invariant mode), and on
    CUDA the norm a row-wise Triton kernel (torch's CUDA mean sizes its blocks by the rows:
    triton_gdn_norms.py, which a trainer's Qwen3_5RMSNormGated runs there too)."""
    if invariant and on_triton(x.device):  # the same numerics, the norm in one order a row
        return invariant_gated_rms_norm(x, gate, weight, eps)
    h = x.float()
    h = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).float()
    return (h * (silu if invariant else F.silu)(gate.float())).to(x.dtype)


def sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x [T, E]; `invariant`: each row on the vector path whatever T (elementwise.py)."""
    return invariant_sigmoid(x) if invariant else torch.sigmoid(x)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; called like an attention module (cos/sin unused)."""

    def __init__(self, config: Any, tp: TPGroup) -> None:
        super().__init__()
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        # this rank's heads (all of them at TP 1)
        self.hk = split_evenly(hk, tp.world_size, "linear_num_key_heads")
        self.hv = split_evenly(hv, tp.world_size, "linear_num_value_heads")
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.width, h = config.linear_conv_kernel_dim, config.hidden_size
        self.parts = [hk * self.dk, hk * self.dk, hv * self.dv]  # the checkpoint's q | k | v
        self.make_projections(h, tp)
        self.conv1d = nn.Conv1d(  # only its weight [C, 1, W] is used
            self.conv_dim, self.conv_dim, self.width, groups=self.conv_dim, bias=False
        )
        self.conv1d.weight.weight_loader = parts_loader(self.parts, tp, "conv1d")  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = parts_loader([hv], tp, "value heads")  # type: ignore[attr-defined]
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(hv * self.dv, h, False, tp)
        self.activation = config.hidden_act
        self.backend: LinearAttentionBackend = get_linear_backend("torch")
        self.conv_state: torch.Tensor | None = None  # [num_slots, C, W - 1]
        self.recurrent_state: torch.Tensor | None = None  # [num_slots, Hv, Dk, Dv] float32

    def make_projections(self, h: int, tp: TPGroup) -> None:
        hv = self.hv * tp.world_size
        self.in_proj_qkv = PartsColumnParallelLinear(h, self.parts, tp)
        self.in_proj_z = ColumnParallelLinear(h, hv * self.dv, False, tp)
        self.in_proj_b = ColumnParallelLinear(h, hv, False, tp)
        self.in_proj_a = ColumnParallelLinear(h, hv, False, tp)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, H] -> (q|k|v [T, C] for the conv, z [T, Hv * Dv], b [T, Hv], a [T, Hv])."""
        return (
            self.in_proj_qkv(hidden), self.in_proj_z(hidden),
            self.in_proj_b(hidden), self.in_proj_a(hidden),
        )  # fmt: skip

    def state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
        """Per-slot (shape, dtype) of each state tensor; None: the model's dtype."""
        return [
            ((self.conv_dim, self.width - 1), None),
            ((self.hv, self.dk, self.dv), torch.float32),
        ]

    def attach_state(self, tensors: list[torch.Tensor]) -> None:
        self.conv_state, self.recurrent_state = tensors

    @property
    def invariant(self) -> bool:
        """The batch-invariant mode (set by the runner: `make_batch_invariant`): the backend
        that runs every token one way (linear_attention/invariant.py), row-wise elementwise."""
        return self.backend.name == "batch_invariant"

    @invariant.setter
    def invariant(self, on: bool) -> None:
        self.backend = get_linear_backend("batch_invariant" if on else "torch")

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b, a [T, Hv] -> (beta, the log decay g), both [T, Hv]."""
        softplus = functools.partial(rowwise, F.softplus) if self.invariant else F.softplus
        g = -self.A_log.float().exp() * softplus(a.float() + self.dt_bias)
        return sigmoid(b, self.invariant), g

    def forward(self, hidden, cos, sin, attn: AttentionMetadata) -> torch.Tensor:
        if self.conv_state is None or self.recurrent_state is None or attn.linear is None:
            raise RuntimeError("GatedDeltaNet: state pools and metadata come from the runner")
        t, meta = hidden.shape[0], attn.linear
        weight = self.conv1d.weight[:, 0]  # [C, W]
        qkv, z, b, a = self.project(hidden)
        if meta.verify is None:
            mixed = self.backend.conv(qkv, weight, None, self.conv_state, meta, self.activation)
        else:  # speculative decoding: verify rows leave their slots as they were (verify.py)
            mixed = verify_conv(self.backend, qkv, weight, self.conv_state, meta, self.activation)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        beta, g = self.gates(b, a)
        args = (
            q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk),
            v.reshape(t, self.hv, self.dv), g, beta,
        )  # fmt: skip
        if meta.verify is None:
            core = self.backend.delta_rule(*args, self.recurrent_state, meta)
        else:
            core = verify_delta_rule(self.backend, *args, self.recurrent_state, meta)
            meta.verify.record(self, meta, qkv, *args)
        z = z.reshape(t, self.hv, self.dv)
        out = gated_rms_norm(core, z, self.norm.weight, self.eps, self.invariant)
        return self.out_proj(out.reshape(t, self.hv * self.dv))


class GatedAttention(nn.Module):
    """Full attention whose output is gated by sigmoid(gate); q/k (1 + w) RMSNorm."""

    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def __init__(self, spec: AttentionSpec, tp: TPGroup) -> None:
        super().__init__()
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        # this rank's query and KV heads (KV heads split, never replicated, here)
        self.h = split_evenly(h, tp.world_size, "num_attention_heads")
        self.kvh = split_evenly(kvh, tp.world_size, "num_key_value_heads")
        self.d = d
        # q_proj rows are per head [q | gate], so a contiguous split keeps heads whole
        self.q_proj = ColumnParallelLinear(spec.hidden_size, 2 * h * d, spec.qkv_bias, tp)
        self.k_proj = ColumnParallelLinear(spec.hidden_size, kvh * d, spec.qkv_bias, tp)
        self.v_proj = ColumnParallelLinear(spec.hidden_size, kvh * d, spec.qkv_bias, tp)
        self.o_proj = RowParallelLinear(h * d, spec.hidden_size, spec.o_bias, tp)
        self.q_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        self.attn = Attention(self.h, self.kvh, d, d**-0.5)
        self.rotary = Rotary()

    def forward(self, hidden, cos, sin, attn: AttentionMetadata) -> torch.Tensor:
        t, h, kvh, d = hidden.shape[0], self.h, self.kvh, self.d
        q, gate = self.q_proj(hidden).view(t, h, 2 * d).split(d, dim=-1)  # per head [q | gate]
        q = self.rotary(self.q_norm(q), cos, sin)
        k = self.rotary(self.k_norm(self.k_proj(hidden).view(t, kvh, d)), cos, sin)
        v = self.v_proj(hidden).view(t, kvh, d)
        out = self.attn(q, k, v, attn).reshape(t, h * d)
        return self.o_proj(out * sigmoid(gate.reshape(t, h * d), self.invariant))


class Qwen3_5ForCausalLM(MtpHost, LlamaForCausalLM):
    """Qwen3.5's text model (`Qwen3_5ForCausalLM`, model type qwen3_5_text); with
    `mtp_num_hidden_layers` in the config and `mtp.*` weights in the checkpoint, its MTP
    module (qwen_mtp.py) for speculative decoding."""

    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "gate_up_proj": ["gate_proj", "up_proj"]
    }
    weight_renames: ClassVar[list[tuple[str, str]]] = [(".linear_attn.", ".self_attn.")]

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        unknown = set(config.layer_types) - {LINEAR, FULL}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)}; known: {LINEAR}, {FULL}")
        super().__init__(config, tp)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        num_mtp = getattr(config, "mtp_num_hidden_layers", 0) or 0
        spec = self.attention_spec(config)
        # an MTP block's MLP is of layer 0's kind (dense, or the MoE), as vLLM builds it
        blocks = [
            self.decoder_layer(config, GatedAttention(spec, self.tp), 0) for _ in range(num_mtp)
        ]
        self.mtp_layers = nn.ModuleList([QwenMtp(config, blocks, self.tp)] if blocks else [])

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        return AttentionSpec.from_config(config, qk_norm=True)

    def linear_mixer(self, config: Any) -> GatedDeltaNet:
        return GatedDeltaNet(config, self.tp)

    def make_mlp(self, config: Any, layer_idx: int) -> tuple[nn.Module, bool]:
        """(the layer's MLP, whether it is an MoE block returning expert ids)."""
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=self.tp)
        return mlp, False

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        linear = config.layer_types[layer_idx] == LINEAR
        mixer = self.linear_mixer(config) if linear else GatedAttention(spec, self.tp)
        return self.decoder_layer(config, mixer, layer_idx)

    def decoder_layer(self, config: Any, mixer: nn.Module, layer_idx: int) -> LlamaDecoderLayer:
        mlp, is_moe = self.make_mlp(config, layer_idx)
        spec = self.attention_spec(config)
        layer = LlamaDecoderLayer(spec, mlp, is_moe=is_moe, tp=self.tp, self_attn=mixer)
        layer.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        layer.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        return layer

    def rename_weight(self, name: str) -> str | None:
        return qwen_mtp_name(name, bool(len(self.mtp_layers)))

    def mtp_step(self, k: int) -> Any:
        return functools.partial(self.mtp_layers[0], k)

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.model.layers.modules() if isinstance(m, GatedDeltaNet)]


class SharedExpertMoe(SparseMoeBlock):
    """Routed experts (softmax, top-k, renormalised) plus a shared expert whose output is
    scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: Any, tp: TPGroup) -> None:
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, config.num_experts,
            config.num_experts_per_tok, True, config.hidden_act, tp,
        )  # fmt: skip
        self.shared_expert = LlamaMLP(
            config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, tp=tp
        )
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, False, tp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed, ids = super().forward(x)
        gate = sigmoid(self.shared_expert_gate(x), self.experts.invariant)  # [T, 1]
        return routed + gate * self.shared_expert(x), ids


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`, model type qwen3_5_moe_text): every
    layer's MLP is a shared-expert MoE, with routed-expert capture."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.num_moe_layers = config.num_hidden_layers
        self.moe_top_k = config.num_experts_per_tok

    def make_mlp(self, config: Any, layer_idx: int) -> tuple[nn.Module, bool]:
        return SharedExpertMoe(config, self.tp), True

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        return expert_mapping(self.config.num_experts, "gate_proj", "up_proj", "down_proj")
