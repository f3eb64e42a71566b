"""Causal depthwise conv1d over packed sequences with a carried state: the reference.

Each channel c of a token t mixes the last W inputs of its sequence:
`out[t, c] = bias[c] + sum_w weight[c, w] * x[t - (W - 1) + w, c]`, then the activation. Inputs
before a chunk's first token come from the sequence's conv state (its last W - 1 inputs, zeros
for a new sequence), kept per sequence in a slot of a pool and updated in place, so chunked
prefill and decode continue exactly where the previous step stopped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal conv1d: unknown activation {activation!r}; known: silu, swish")


def causal_conv1d(
    x: torch.Tensor,  # [T, C] the step's tokens, sequences packed
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1] updated in place
    query_start_loc: list[int],  # [B + 1] sequence i's tokens are [qsl[i], qsl[i + 1])
    state_slots: list[int],  # [B] the slot holding each sequence's state
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] in x's dtype
    out = torch.empty_like(x)
    for i, slot in enumerate(state_slots):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        # [C, W - 1 + L]: the carried inputs, then this chunk's
        window = torch.cat([conv_state[slot].to(weight.dtype), x[rows].T.to(weight.dtype)], dim=1)
        y = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
        out[rows] = activate(y, activation).T.to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - conv_state.shape[2] :].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [B, C] one new token per sequence
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1] updated in place
    state_slots: torch.Tensor,  # [B] int64
    activation: str | None = "silu",
) -> torch.Tensor:  # [B, C]
    """The decode step: device ops only, so it replays from a captured graph."""
    window = torch.cat([conv_state[state_slots], x[:, :, None].to(conv_state.dtype)], dim=2)
    y = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        y = y + bias
    conv_state[state_slots] = window[:, :, 1:]
    return activate(y, activation).to(x.dtype)
