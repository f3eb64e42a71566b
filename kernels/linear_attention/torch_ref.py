"""Linear attention over packed varlen steps in plain torch: the reference backend.

Prefill chunks run the chunked gated delta rule one sequence at a time (planned on the host);
decodes run one batched recurrent step on device tensors only, so they replay from a graph.
"""

from __future__ import annotations

import torch
from raylane.kernels.linear_attention.conv1d import causal_conv1d, causal_conv1d_update
from raylane.kernels.linear_attention.gated_delta import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from raylane.kernels.linear_attention.metadata import StateMetadata, host_lists


class TorchLinearAttention:
    name = "torch"

    def __init__(self, chunk_size: int = 64):
        self.chunk_size = chunk_size

    def conv(self, x, weight, bias, conv_state, meta: StateMetadata, activation="silu"):
        """[T, C] -> [T, C]: causal conv1d of every sequence, its conv state carried."""
        out = torch.empty_like(x)
        split = meta.num_prefill_tokens
        if meta.num_prefills:
            qsl, slots = host_lists(meta)
            out[:split] = causal_conv1d(
                x[:split], weight, bias, conv_state, qsl, slots[: meta.num_prefills], activation
            )
        if split < x.shape[0]:
            decode_slots = meta.state_slots[meta.num_prefills :]
            out[split:] = causal_conv1d_update(
                x[split:], weight, bias, conv_state, decode_slots, activation
            )
        return out

    def delta_rule(self, q, k, v, g, beta, state, meta: StateMetadata, l2norm: bool = True):
        """[T, H, D] -> [T, Hv, Dv]: the gated delta rule, `state` [slots, Hv, Dk, Dv] carried."""
        out = v.new_empty(v.shape)
        split = meta.num_prefill_tokens
        if meta.num_prefills:
            qsl, slots = host_lists(meta)
            for i in range(meta.num_prefills):
                rows = slice(qsl[i], qsl[i + 1])
                out[rows], final = chunk_gated_delta_rule(
                    q[rows], k[rows], v[rows], g[rows], beta[rows], state[slots[i]],
                    self.chunk_size, l2norm,
                )  # fmt: skip
                state[slots[i]] = final
        if split < v.shape[0]:
            slots_t = meta.state_slots[meta.num_prefills :]
            rows = slice(split, None)
            o, final = recurrent_gated_delta_rule(
                q[rows, None], k[rows, None], v[rows, None], g[rows, None], beta[rows, None],
                state[slots_t], l2norm,
            )  # fmt: skip
            out[rows] = o[:, 0]
            state[slots_t] = final.to(state.dtype)
        return out
