"""Qwen3.5's and Qwen3-Next's multi-token-prediction (MTP) module, for speculative decoding.

Like DeepSeek's (mtp.py), it predicts the token after next: row p takes the embedding of token
p + 1 and the main model's (final-normed) hidden state at p, `fc([pre_fc_norm_embedding(embed)
| pre_fc_norm_hidden(hidden)])`, runs one gated full-attention decoder block (with its own
paged K/V rows, and the model's MLP kind: dense for Qwen3.5, the shared-expert MoE for
Qwen3.5-MoE and Qwen3-Next), then its own `norm`; the logits come from the main LM head.
The norms are zero-centred (1 + w), as the model's.

Checkpoint layout (the official Qwen3.5 / Qwen3-Next checkpoints; `mtp_num_hidden_layers` in
the config): `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`
shared by the blocks `mtp.layers.{i}.*` (named as a main decoder layer's). Here they load as
`mtp_layers.0.*` (one predictor; the runner runs its block 0 at every draft step, chained
ones included). transformers does not implement the module (it drops `mtp.*` on load), so a
checkpoint HF saved has none of them.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.layers import ReplicatedLinear
from raylane.actors.models.llama import LlamaDecoderLayer
from raylane.actors.models.tp_group import TPGroup
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.norm import GemmaRMSNorm
from torch import nn


class QwenMtp(nn.Module):
    def __init__(self, config: Any, blocks: list[LlamaDecoderLayer], tp: TPGroup) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ReplicatedLinear(2 * h, h, bias=False, tp=tp)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        self.layers = nn.ModuleList(blocks)
        self.norm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        step: int,
        embeds: torch.Tensor,
        previous_hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embeds [T, H] of tokens p + 1, previous_hidden [T, H] at p -> (hidden [T, H] for
        the LM head, routed expert ids [T, 1, k] or None)."""
        e, h = self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous_hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        block = self.layers[step % len(self.layers)]
        hidden, residual, routed = block(x, None, cos, sin, attn)
        hidden, _ = self.norm(hidden, residual)
        return hidden, (routed.unsqueeze(1) if routed is not None else None)


def qwen_mtp_name(name: str, has_mtp: bool) -> str | None:
    """A checkpoint name -> ours: `mtp.X` -> `mtp_layers.0.X` (None when the model built no
    MTP module); any other name unchanged."""
    if not name.startswith("mtp."):
        return name
    return "mtp_layers.0." + name.removeprefix("mtp.") if has_mtp else None
