"""The Triton linear-attention backend: one launch per op for the whole step (prefills and
decodes alike), the same interface as the torch reference."""

from __future__ import annotations

from raylane.kernels.linear_attention.metadata import StateMetadata
from raylane.kernels.linear_attention.triton_kernels import causal_conv1d, gated_delta_rule


class TritonLinearAttention:
    name = "triton"

    def conv(self, x, weight, bias, conv_state, meta: StateMetadata, activation="silu"):
        return causal_conv1d(
            x, weight, bias, conv_state, meta.query_start_loc, meta.state_slots,
            meta.max_query_len, activation,
        )  # fmt: skip

    def delta_rule(self, q, k, v, g, beta, state, meta: StateMetadata, l2norm: bool = True):
        return gated_delta_rule(
            q, k, v, g, beta, state, meta.query_start_loc, meta.state_slots, l2norm
        )
