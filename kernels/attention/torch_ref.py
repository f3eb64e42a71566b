"""Reference attention in plain torch: runs on CPU and GPU, and is the ground truth in tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.metadata import AttentionMetadata, PaddedBatch


class TorchAttention:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for group in meta.groups:
            rows = slice(group.start, group.start + group.num_tokens)
            if group.fresh:
                out[rows] = attend_fresh(q[rows], k[rows], v[rows], group, scale)
            else:
                out[rows] = attend_padded(q[rows], k_cache, v_cache, group, scale)
        return out


def store_kv(k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def attend_padded(q, k_cache, v_cache, group: PaddedBatch, scale: float) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    batch, max_q = group.batch, group.max_q
    if group.flat_index is None:  # decode: one query per sequence
        qp = q.view(batch, 1, num_heads, head_dim)
    else:  # padded query rows are never read back, so they may hold anything
        qp = _pad(q, group, q.new_empty)
    # index_select on the flat slot list is several times faster than advanced indexing on CPU
    slots = group.gather_slots.view(-1)
    ctx_shape = (batch, group.gather_slots.shape[1], k_cache.shape[1], head_dim)
    # [batch, max_ctx, num_kv_heads, head_dim] -> [batch, num_kv_heads, max_ctx, head_dim]
    kp = k_cache.index_select(0, slots).view(ctx_shape).transpose(1, 2)
    vp = v_cache.index_select(0, slots).view(ctx_shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), kp, vp, attn_mask=group.mask, scale=scale,
        enable_gqa=kp.shape[1] != num_heads,
    )  # [batch, num_heads, max_q, head_dim]
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
    if group.flat_index is None:
        return out
    return out.index_select(0, group.flat_index)


def attend_fresh(q, k, v, group: PaddedBatch, scale: float) -> torch.Tensor:
    """Prefills that start at position 0: causal attention over the step's own K/V.

    For a real query i every key j <= i is real, so the padding never needs a mask; padded K/V
    rows are zeros so that no garbage (nan) can meet a zero attention weight.
    """
    qp = _pad(q, group, q.new_empty)
    kp, vp = _pad(k, group, k.new_zeros), _pad(v, group, v.new_zeros)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # [batch, num_heads, max_q, head_dim]
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]).index_select(0, group.flat_index)


def _pad(x: torch.Tensor, group: PaddedBatch, alloc) -> torch.Tensor:
    """Flat rows [num_tokens, H, D] -> [batch, max_q, H, D] laid out per sequence."""
    padded = alloc(group.batch * group.max_q, x.shape[1], x.shape[2])
    padded.index_copy_(0, group.flat_index, x)
    return padded.view(group.batch, group.max_q, x.shape[1], x.shape[2])
