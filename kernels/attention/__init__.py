"""Paged attention: KV store into slots, prefill (varlen, causal) and decode over block tables.

Backends come from a registry (`get_backend`) chosen once at start-up; `torch` is the reference
and runs everywhere.
"""

from __future__ import annotations

from raylane.kernels.attention.metadata import AttentionMetadata, SeqSlice
from raylane.kernels.attention.registry import (
    AttentionBackend,
    BackendRequest,
    available_backends,
    get_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendRequest",
    "SeqSlice",
    "available_backends",
    "get_backend",
]
