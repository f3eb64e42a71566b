"""DeepSeek's multi-token-prediction (MTP) layers, for speculative decoding.

MTP layer k predicts the token after next: it takes the embedding of token p + 1 and the
main model's (final-normed) hidden state at position p, `eh_proj([enorm(embed) |
hnorm(hidden)])`, runs one full decoder block (MLA attention with its own latent cache, and
the MoE), then its own norm (`shared_head.norm` in checkpoints). The logits come from the main
model's LM head (`compute_logits`), as the checkpoints' `shared_head.head` is a copy of it.

Checkpoint layout (DeepSeek-V3 / R1 and derived): MTP layer k is `model.layers.{L + k}.*` with
L = num_hidden_layers: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`,
`embed_tokens` (the last two shared with the main model, skipped) and the block's own
`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from raylane.actors.models.attention import Attention
from raylane.actors.models.layers import ReplicatedLinear
from raylane.actors.models.llama import LlamaDecoderLayer
from raylane.actors.models.tp_group import TPGroup
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.norm import RMSNorm
from torch import nn

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_OWN = ("enorm.", "hnorm.", "eh_proj.")  # checkpoint prefixes that stay as they are


class MtpLayer(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, block: LlamaDecoderLayer, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size, bias=False, tp=tp)
        self.mtp_block = block
        self.post_norm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embeds [T, H] of tokens p + 1, previous_hidden [T, H] at p -> (hidden [T, H] for the
        LM head, routed expert ids [T, 1, k] or None)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        hidden, residual, routed = self.mtp_block(x, None, cos, sin, attn)
        hidden, _ = self.post_norm(hidden, residual)
        return hidden, (routed.unsqueeze(1) if routed is not None else None)


def mtp_checkpoint_name(name: str, num_hidden_layers: int) -> str | None:
    """A checkpoint name -> ours: `model.layers.{L + k}.X` -> `mtp_layers.k.X` (the block's
    weights under `mtp_block.`), None for the copies of the shared embedding and head; any
    other name unchanged."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) < num_hidden_layers:
        return name
    k, rest = int(match.group(1)) - num_hidden_layers, match.group(2)
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None
    if rest.startswith("shared_head.norm."):
        return f"mtp_layers.{k}.post_norm.{rest.removeprefix('shared_head.norm.')}"
    if rest.startswith(_OWN):
        return f"mtp_layers.{k}.{rest}"
    return f"mtp_layers.{k}.mtp_block.{rest}"


class MtpHost:
    """What a model with MTP layers gives the runner (mixed in before the model's base class):
    `mtp_layers` (loaded ones; empty when the checkpoint had none of their weights), their
    attention layers after the main ones (cache rows at the same slots), and
    `mtp_forward(k, input_ids, positions, previous_hidden, attn)`, one draft step over T
    tokens (see DeepseekV3ForCausalLM's docstring). A model sets `mtp_layers` and says how
    step k runs (`mtp_step`)."""

    mtp_layers: nn.ModuleList
    model: Any

    def mtp_step(self, k: int) -> Any:
        """The module that runs draft step k: (embeds, previous_hidden, cos, sin, attn) ->
        (hidden, routed)."""
        return self.mtp_layers[k]

    def prune_unloaded(self, loaded: set[str]) -> bool:
        """Drop the MTP layers when the checkpoint had none of their weights."""
        if not len(self.mtp_layers) or any(n.startswith("mtp_layers.") for n in loaded):
            return False
        self.mtp_layers = nn.ModuleList()
        return True

    def attention_layers(self) -> list[Attention]:
        mtp = [m for m in self.mtp_layers.modules() if isinstance(m, Attention)]
        return super().attention_layers() + mtp  # type: ignore[misc]

    def mtp_forward(
        self,
        k: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(positions)
        return self.mtp_step(k)(embeds, previous_hidden, cos, sin, attn)
