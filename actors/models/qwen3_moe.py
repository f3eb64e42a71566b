"""Sparse-MoE decoders: Qwen3-MoE (the Qwen3 decoder with MoE MLPs on the layers the config
selects) and Mixtral (the Llama decoder with an MoE MLP on every layer).

Qwen3-MoE: a layer is MoE when it is not in `mlp_only_layers` and
`(idx + 1) % decoder_sparse_step == 0` (as in HF), so dense and MoE layers mix.
Each MoE layer returns the expert ids it routed to.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
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
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Qwen3ForCausalLM,
)
from raylane.kernels.moe import fused_moe
from torch import nn


class FusedMoE(nn.Module):
    """All experts of a layer as two 3-D weights; expert MLPs split by intermediate size under TP.

    w13_weight [E, 2 * I_local, H] holds gate rows then up rows; w2_weight [E, H, I_local].
    """

    invariant = False  # the batch-invariant mode (set by the runner: `make_batch_invariant`)

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        self.local = divide(intermediate_size, self.tp.world_size, "moe_intermediate_size")
        self.w13_weight = new_param((num_experts, 2 * self.local, hidden_size), self.weight_loader)
        self.w2_weight = new_param((num_experts, hidden_size, self.local), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        """shard_id = (expert, part): part gate/up/down for one expert's 2-D weight, or
        (None, gate_up/down) for transformers 5's fused 3-D tensors of all experts."""
        expert, part = shard_id
        rank, n = self.tp.rank, self.local
        full = n * self.tp.world_size  # the checkpoint's intermediate size
        if expert is None:  # [E, 2I, H] or [E, H, I]
            if part == "down":
                src = split_rows(loaded, 2, full, rank, n, "experts.down_proj")
                copy_checked(param.data, src, "experts.down_proj")
                return
            # gate rows [0, I), up rows [I, 2I): each part's rank slice
            both = split_rows(loaded, 1, 2 * full, 0, 2 * full, "experts.gate_up_proj")
            copy_checked(param.data[:, :n], both.narrow(1, rank * n, n), "experts.gate_proj")
            copy_checked(param.data[:, n:], both.narrow(1, full + rank * n, n), "experts.up_proj")
        elif part == "down":  # [H, I]
            what = f"expert {expert} down"
            copy_checked(param.data[expert], split_rows(loaded, 1, full, rank, n, what), what)
        else:  # gate or up, [I, H]
            rows = slice(0, n) if part == "gate" else slice(n, 2 * n)
            what = f"expert {expert} {part}"
            copy_checked(param.data[expert, rows], split_rows(loaded, 0, full, rank, n, what), what)


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + experts; routing is softmax -> top-k (-> renormalise)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        hidden_act: str,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: {top_k} must be in [1, {num_experts}]")
        self.tp = tp or TPGroup()
        self.top_k, self.renormalize, self.hidden_act = top_k, renormalize, hidden_act
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, tp=tp)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (out [T, H], expert ids [T, top_k] int32)."""
        router_logits = self.gate(x)  # [T, E]
        out, ids = fused_moe(
            x,
            router_logits,
            self.experts.w13_weight,
            self.experts.w2_weight,
            self.top_k,
            self.renormalize,
            self.hidden_act,
            self.experts.invariant,
        )
        return self.tp.all_reduce(out), ids


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


def expert_mapping(num_experts: int, gate: str, up: str, down: str) -> list[tuple[str, str, Any]]:
    """(our param fragment, checkpoint fragment, shard id) for per-expert and fused 3-D names."""
    mapping: list[tuple[str, str, Any]] = [
        ("experts.w13_weight", "experts.gate_up_proj", (None, "gate_up")),
        ("experts.w2_weight", "experts.down_proj", (None, "down")),
    ]
    for e in range(num_experts):
        mapping += [
            ("experts.w13_weight", f"experts.{e}.{gate}.weight", (e, "gate")),
            ("experts.w13_weight", f"experts.{e}.{up}.weight", (e, "up")),
            ("experts.w2_weight", f"experts.{e}.{down}.weight", (e, "down")),
        ]
    return mapping


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.num_moe_layers = sum(is_moe_layer(config, i) for i in range(config.num_hidden_layers))
        self.moe_top_k = config.num_experts_per_tok if self.num_moe_layers else 0

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        if is_moe_layer(config, layer_idx):
            moe = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                bool(getattr(config, "norm_topk_prob", True)),
                config.hidden_act,
                self.tp,
            )
            return LlamaDecoderLayer(spec, moe, is_moe=True, tp=self.tp)
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=self.tp)
        return LlamaDecoderLayer(spec, mlp, is_moe=False, tp=self.tp)

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        return expert_mapping(self.config.num_experts, "gate_proj", "up_proj", "down_proj")


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: the Llama decoder with a renormalised top-k MoE MLP on every layer.

    Checkpoints name the block `block_sparse_moe` and the expert weights w1 (gate), w3 (up),
    w2 (down); transformers 5 names it `mlp`, like this module.
    """

    weight_renames: ClassVar[list[tuple[str, str]]] = [(".block_sparse_moe.", ".mlp.")]

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("sliding_window: sliding-window attention is not supported")
        super().__init__(config, tp)
        self.num_moe_layers = config.num_hidden_layers
        self.moe_top_k = config.num_experts_per_tok

    def make_layer(self, config: Any, spec: AttentionSpec, layer_idx: int) -> LlamaDecoderLayer:
        moe = SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,
            config.hidden_act,
            self.tp,
        )
        return LlamaDecoderLayer(spec, moe, is_moe=True, tp=self.tp)

    def expert_params_mapping(self) -> list[tuple[str, str, Any]]:
        return expert_mapping(self.config.num_local_experts, "w1", "w3", "w2")
