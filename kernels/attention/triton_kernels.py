"""Paged attention kernels in Triton: KV store, split-K decode and varlen causal prefill.

Each layer's cache is `[num_slots, num_kv_heads, head_dim]` for K and
`[num_slots, num_kv_heads, v_dim]` for V, v_dim <= head_dim (MLA's absorbed form passes the
latent part of its key cache as V, a view with the key rows' slot stride); slot
`block * block_size + offset` holds the token at `offset` of KV block `block`, and a sequence's
block table row lists its blocks in position order (entries past its last block are never read).
Query head h reads KV head `h // (num_heads // num_kv_heads)`.

Launchers read only shapes, strides and host ints, never device values (no `.item()`), so every
launch can be captured in a CUDA graph. This module imports triton: callers check
`importlib.util.find_spec("triton")` before importing it.
"""

from raylane.kernels.attention.triton_common import LOG2E
from raylane.kernels.attention.triton_decode import decode_attention, pick_num_splits
from raylane.kernels.attention.triton_prefill import prefill_attention
from raylane.kernels.attention.triton_store import store_kv

__all__ = ["LOG2E", "decode_attention", "pick_num_splits", "prefill_attention", "store_kv"]
