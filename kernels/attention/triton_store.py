"""The Triton KV store: each step's K/V rows into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.attention.triton_common import _require_unit_last_stride, _row_head_strides


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # a padding token (e.g. in a captured CUDA graph) is not stored
        return
    h, d = tl.arange(0, H_PAD)[:, None], tl.arange(0, D_PAD)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    key = tl.load(k + t * stride_kt + h * stride_kh + d, mask=ok)
    tl.store(
        k_cache + slot * stride_kcs + h * stride_kch + d, key.to(k_cache.dtype.element_ty), mask=ok
    )
    v_ok = (h < NUM_KV_HEADS) & (d < V_DIM)
    value = tl.load(v + t * stride_vt + h * stride_vh + d, mask=v_ok)
    tl.store(
        v_cache + slot * stride_vcs + h * stride_vch + d,
        value.to(v_cache.dtype.element_ty),
        mask=v_ok,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row t of k and v to slot `slot_mapping[t]` of the caches; a negative slot is skipped.

    k [T, KVH, D], v [T, KVH, Dv <= D], any row and head strides (views of a fused qkv
    output); caches [num_slots, KVH, D] and [num_slots, KVH, Dv]; slot_mapping [T] int64.
    Values are cast to the cache dtype.
    """
    _check_kv_shapes(k, v, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *_row_head_strides(k, v, k_cache, v_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        V_DIM=v.shape[2],
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )


def _check_kv_shapes(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    _require_unit_last_stride(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if not (
        k.shape[1:] == k_cache.shape[1:]
        and v.shape[1:] == v_cache.shape[1:]
        and v.shape[:2] == k.shape[:2]
        and v.shape[2] <= k.shape[2]
    ):
        raise ValueError(
            f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
