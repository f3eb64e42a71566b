"""DeepSeek-V3 / R1: MLA attention (mla.py) on every layer, and DeepSeek's MoE on every layer
from `first_k_dense_replace` on (the first ones are dense MLPs). Also DeepSeek-V2 (the same
MLA, softmax routing) and GLM-4.5 / 4.6 (V3's MoE under GQA attention).

DeepSeek's MoE: a float32 router with sigmoid scores; the choice adds
`e_score_correction_bias` and keeps to the `topk_group` best of `n_group` expert groups; the
weights are the unbiased scores (renormalised with `norm_topk_prob`) times
`routed_scaling_factor` (kernels/moe.select_experts_grouped). Shared experts (one MLP
`n_shared_experts` times as wide) see every token. Each MoE layer returns the routed ids.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from raylane.actors.models.llama import (
    AttentionSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
)
from raylane.actors.models.llama import LlamaForCausalLM as _Llama
from raylane.actors.models.mla import MLASpec, MLAttention
from raylane.actors.models.mtp import MtpHost, MtpLayer, mtp_checkpoint_name
from raylane.actors.models.qwen3_moe import FusedMoE, expert_mapping
from raylane.actors.models.tp_group import TPGroup
from raylane.kernels.batch_invariant import padded_linear
from raylane.kernels.moe import (
    expert_forward,
    select_experts_grouped,
    select_experts_softmax_grouped,
)
from torch import nn


def router_logits(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x [T, H] -> float32 [T, E] through the float32 gate weight; `invariant`: the padded
    matmul (F.linear in float32 reduces in an order that follows T)."""
    if invariant:
        return padded_linear(x.float(), weight)
    return F.linear(x.float(), weight)


class GroupedTopkRouter(nn.Module):
    """The gate: float32 weight [E, H] and the choice's bias [E] (HF keeps both in float32)."""

    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(
            torch.empty(experts, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(experts, dtype=torch.float32), requires_grad=False
        )
        self.top_k, self.num_groups = config.num_experts_per_tok, config.n_group or 1
        self.topk_groups = config.topk_group or 1
        self.renormalize = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        if experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"n_group: {self.num_groups} must divide n_routed_experts {experts} and be "
                f">= topk_group {self.topk_groups}"
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = router_logits(x, self.weight, self.invariant)  # [T, E]
        return select_experts_grouped(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.renormalize,
            self.scaling,
            self.invariant,
        )


class SoftmaxGroupedRouter(nn.Module):
    """DeepSeek-V2's gate: float32 weight [E, H], softmax scores, `topk_method` "greedy" or
    "group_limited_greedy" (select_experts_softmax_grouped)."""

    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(
            torch.empty(experts, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        method = config.topk_method
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: {method!r} is not 'greedy' or 'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        self.top_k, self.scaling = config.num_experts_per_tok, float(config.routed_scaling_factor)
        self.num_groups = (config.n_group or 1) if grouped else 1
        self.topk_groups = config.topk_group or 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, self.weight, self.invariant)  # [T, E]
        return select_experts_softmax_grouped(
            logits, self.top_k, self.num_groups, self.topk_groups, self.scaling
        )


class DeepseekMoE(nn.Module):
    def __init__(
        self, config: Any, tp: TPGroup | None = None, router: type[nn.Module] = GroupedTopkRouter
    ) -> None:
        super().__init__()
        self.tp, self.hidden_act = tp or TPGroup(), config.hidden_act
        size = config.moe_intermediate_size
        self.gate = router(config)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, size, tp)
        shared = config.n_shared_experts or 0
        self.shared_experts = (
            LlamaMLP(config.hidden_size, size * shared, config.hidden_act, tp=tp)
            if shared
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], expert ids [T, k] int32)."""
        weights, ids = self.gate(x)  # float32
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight
        if not self.experts.invariant:  # the mode keeps them float32, as transformers does
            weights = weights.to(x.dtype)
        out = self.tp.all_reduce(
            expert_forward(
                x,
                w13,
                w2,
                weights,
                ids,
                self.hidden_act,
                invariant=self.experts.invariant,
            )
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, ids.to(torch.int32)


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    kinds = getattr(config, "mlp_layer_types", None)  # V3.2: "dense" / "sparse" per layer
    if kinds is not None:
        return kinds[layer_idx] == "sparse"
    return bool(config.n_routed_experts) and layer_idx >= (config.first_k_dense_replace or 0)


class DeepseekV3ForCausalLM(MtpHost, _Llama):
    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    """DeepSeek-V3 / R1.

    MTP layers (`num_nextn_predict_layers`, see mtp.py) are built when the config names them
    and kept when the checkpoint has their weights (HF-saved checkpoints have none: then
    `mtp_layers` is empty). They load, shard and take weight updates like every layer; their
    attention layers come last in `attention_layers()`, so the runner gives them latent cache
    rows like the main layers'. API for speculative decoding:

    - `mtp_layers`: the loaded MTP layers (`len(...)` is how many draft steps they give);
    - `mtp_forward(k, input_ids, positions, previous_hidden, attn)`: one step of MTP layer k
      over T tokens; `input_ids` [T] are the tokens at positions p + 1 (`positions` [T] their
      positions), `previous_hidden` [T, H] the hidden states this model's `forward` returned
      at p (after its final norm, as vLLM feeds them) or the previous MTP layer's output;
      `attn` is ordinary metadata for those positions (the layer writes its own cache rows at
      `slot_mapping`). Returns (hidden [T, H], routed [T, 1, k] or None); `compute_logits`
      turns the hidden states into the draft distribution.
    """

    router: type[nn.Module] = GroupedTopkRouter

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.num_moe_layers = sum(is_moe_layer(config, i) for i in range(config.num_hidden_layers))
        self.moe_top_k = config.num_experts_per_tok if self.num_moe_layers else 0
        num_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        self.mtp_layers = nn.ModuleList([self._mtp_layer(config) for _ in range(num_mtp)])

    def _mtp_layer(self, config: Any) -> MtpLayer:
        spec = self.attention_spec(config)
        moe = DeepseekMoE(config, self.tp, self.router)  # MTP blocks are always MoE
        block = LlamaDecoderLayer(spec, moe, True, self.tp, self.make_attention(config, spec))
        return MtpLayer(config.hidden_size, config.rms_norm_eps, block, self.tp)

    def rename_weight(self, name: str) -> str | None:
        """Checkpoint MTP layers -> `mtp_layers.k.*`; None skips the ones this model lacks."""
        ours = mtp_checkpoint_name(name, self.config.num_hidden_layers)
        if ours is not None and ours.startswith("mtp_layers."):
            return ours if int(ours.split(".")[1]) < len(self.mtp_layers) else None
        return ours

    def make_attention(self, config: Any, spec: AttentionSpec) -> nn.Module:
        return MLAttention(MLASpec.from_config(config), self.tp)

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        attn = self.make_attention(config, spec)
        if is_moe_layer(config, layer_idx):
            moe = DeepseekMoE(config, self.tp, self.router)
            return LlamaDecoderLayer(spec, moe, True, self.tp, attn)
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=self.tp)
        return LlamaDecoderLayer(spec, mlp, False, self.tp, attn)

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        return expert_mapping(self.config.n_routed_experts, "gate_proj", "up_proj", "down_proj")


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5 / 4.6: DeepSeek-V3's MoE (the same router, shared experts and dense first
    layers) under standard GQA attention: q/k/v bias from `attention_bias` (o_proj none),
    optional per-head q/k RMSNorm (`use_qk_norm`), RoPE on the leading
    `partial_rotary_factor` of each head."""

    stacked_params_mapping = _Llama.stacked_params_mapping
    packed_modules_mapping = _Llama.packed_modules_mapping

    @classmethod
    def attention_spec(cls, config: Any) -> AttentionSpec:
        qk_norm = bool(getattr(config, "use_qk_norm", False))
        return AttentionSpec.from_config(config, o_bias=False, qk_norm=qk_norm)

    def make_attention(self, config: Any, spec: AttentionSpec) -> nn.Module:
        return LlamaAttention(spec, self.tp)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite: V3's MLA (its complex-number RoPE keeps each rotated pair
    together where V3 de-interleaves them: the same permutation of q's and k's rope dims, so
    the same scores) with softmax routing, no correction bias."""

    router = SoftmaxGroupedRouter
