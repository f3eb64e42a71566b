"""Linear attention (Gated DeltaNet): causal conv1d and the gated delta rule over packed steps,
with per-sequence conv and recurrent state kept in slots of fixed pools.

Backends come from a registry (`get_linear_backend`); `torch` is the reference.
"""

from __future__ import annotations

from raylane.kernels.linear_attention.metadata import StateMetadata
from raylane.kernels.linear_attention.registry import LinearAttentionBackend, get_linear_backend

__all__ = ["LinearAttentionBackend", "StateMetadata", "get_linear_backend"]
