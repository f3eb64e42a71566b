"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5-MoE's layers (Gated DeltaNet and gated full
attention, three to one by default; a shared-expert MoE) with two differences in the checkpoint
and the config:
- the linear layers' input projections are fused per key head: `in_proj_qkvz` holds, for each
  key head, its q [Dk], k [Dk], then its Hv / Hk value heads' v and z; `in_proj_ba` its value
  heads' b then a. The loader regroups the rows once into [q | k | v | z] and [b | a], so the
  step splits contiguous column ranges (`HeadGroupedLinear`);
- a layer's MLP is the MoE only where `decoder_sparse_step` and `mlp_only_layers` say so (a
  dense MLP elsewhere); routed experts are captured for the MoE layers.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.checkpoint import materialize
from raylane.actors.models.layers import Loaded, ReplicatedLinear, copy_checked
from raylane.actors.models.llama import LlamaMLP
from raylane.actors.models.qwen3_5 import GatedDeltaNet, Qwen3_5MoeForCausalLM, SharedExpertMoe
from raylane.actors.models.qwen3_moe import is_moe_layer
from raylane.actors.models.tp_group import TPGroup
from raylane.actors.models.tp_shape import split_evenly
from torch import nn


class HeadGroupedLinear(ReplicatedLinear):
    """A linear whose checkpoint rows come grouped by key head ([head][part] order) and are
    kept grouped by part ([part][head]), so each part is one contiguous output range. Under
    tensor parallelism a rank keeps its key heads' groups (`groups` counts them all)."""

    def __init__(self, input_size: int, groups: int, parts: list[int], tp: TPGroup) -> None:
        self.groups, self.parts = groups, parts
        self.local = split_evenly(groups, tp.world_size, "linear_num_key_heads")
        super().__init__(input_size, self.local * sum(parts), False, tp)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: Any = None):
        t, what = materialize(loaded), type(self).__name__
        if tuple(t.shape) != (self.groups * sum(self.parts), param.shape[1]):
            raise ValueError(f"weight {what}: checkpoint tensor has shape {tuple(t.shape)}")
        mine = t.reshape(self.groups, sum(self.parts), -1).narrow(
            0, self.tp.rank * self.local, self.local
        )
        regrouped = torch.cat([p.reshape(-1, t.shape[1]) for p in mine.split(self.parts, dim=1)])
        copy_checked(param.data, regrouped, what)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def make_projections(self, h: int, tp: TPGroup) -> None:
        r, groups = self.hv // self.hk, self.hk * tp.world_size  # value heads per key head
        parts = [self.dk, self.dk, r * self.dv, r * self.dv]
        self.in_proj_qkvz = HeadGroupedLinear(h, groups, parts, tp)
        self.in_proj_ba = HeadGroupedLinear(h, groups, [r, r], tp)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.hv * self.dv], dim=-1)
        b, a = self.in_proj_ba(hidden).split(self.hv, dim=-1)
        return qkv.contiguous(), z, b, a


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next (model type qwen3_next)."""

    def __init__(self, config: Any, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        self.num_moe_layers = sum(is_moe_layer(config, i) for i in range(config.num_hidden_layers))
        self.moe_top_k = config.num_experts_per_tok if self.num_moe_layers else 0

    def linear_mixer(self, config: Any) -> GatedDeltaNet:
        return Qwen3NextGatedDeltaNet(config, self.tp)

    def make_mlp(self, config: Any, layer_idx: int) -> tuple[nn.Module, bool]:
        if is_moe_layer(config, layer_idx):
            return SharedExpertMoe(config, self.tp), True
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act), False
