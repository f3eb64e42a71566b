"""The C paged-attention kernel for the CPU: built once per machine, loaded with ctypes.

The source is plain C (csrc/paged_attention.c, no torch headers), so a build takes about a
second; kernels/cpu_build.py builds and caches it.

`paged_attention`'s layout: q [T, H, D], out [T, H, Dv] (last dim contiguous; any row and head
strides, e.g. q sliced from a fused qkv); k_cache [num_slots, KVH, D] contiguous, slot = block *
block_size + offset; v_cache [num_slots, KVH, Dv] with Dv <= D, heads contiguous, any slot stride
(MLA passes the latent part of its key cache, a view); block_tables [B, W] int32; seq_lens [B]
int32, context length after this step; query_start_loc [B + 1] int32, sequence i owns rows
[qsl[i], qsl[i + 1]). Query j of sequence i sits at position seq_lens[i] - q_len + j and sees keys
0..that position, read from the cache (this step's K/V must already be stored). Query head h
reads KV head h // (H // KVH). Sequences with no queries contribute nothing; rows of q past
query_start_loc[B] are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from raylane.kernels.cpu_build import DTYPES, load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
_DTYPES = DTYPES
_ERRORS = {  # return codes of raylane_paged_attention
    1: "sizes must be positive and num_heads a multiple of num_kv_heads",
    2: "dtype is not supported by this build (float16 needs compiler support)",
    3: "query_start_loc must be non-decreasing, start at >= 0 and end at <= num_tokens",
    4: "seq_lens must be >= the sequence's query count",
    5: "block_tables must hold ceil(seq_len / block_size) block ids < num_slots // block_size",
    6: "out of memory",
}


def is_available() -> bool:
    """True when the kernel is built (or was already cached) and loads; never raises."""
    return _library() is not None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    block_size: int,
    num_threads: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    aligned: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context, laid out as the
    module docstring says; writes and returns out. With a `window`, a query sees only its last
    `window` keys (blocks before them are never read); `sinks` [H]: per-head logits joining
    each softmax's denominator. `aligned` (the batch-invariant mode): a window's key chunks
    start at multiples of the kernel's chunk width, as full attention's do, so a query row
    reduces in one order whatever tile or prefill split it falls in (without it they start at
    a tile's first window). `block_size` is slots per block (the shapes do not tell it). Runs
    on `num_threads` OpenMP threads (default torch.get_num_threads()).

    Raises ValueError on bad arguments, block ids and lengths included (checked in C before
    anything is read through them), and RuntimeError when the kernel is unavailable.
    """
    lib = _loaded_library()
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    sizes = _checked_sizes(*tensors)
    sinks = _checked_sinks(sinks, q.shape[1])  # kept alive here while the C code reads it
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 or None, got {window}")
    threads = num_threads or torch.get_num_threads()
    sinks_ptr = None if sinks is None else sinks.data_ptr()
    options = (block_size, scale, _DTYPES[q.dtype], threads, window or 0, sinks_ptr, int(aligned))
    _call_kernel(lib.raylane_paged_attention, [t.data_ptr() for t in tensors], sizes, options)
    return out


def _loaded_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel could not be built; see the log")
    return lib


def _checked_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    if sinks is None:
        return None
    sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()  # read by the C code
    if sinks.shape != (num_heads,):
        raise ValueError(f"paged_attention: sinks must be [{num_heads}], got {sinks.shape}")
    return sinks


def _call_kernel(fn, pointers: list[int], sizes: tuple[int, ...], options: tuple) -> None:
    # the C call: pointers, sizes, options as _library() declares them, then the bad sequence
    bad_seq = ctypes.c_int(-1)
    rc = fn(*pointers, *sizes, *options, ctypes.byref(bad_seq))
    if rc != 0:
        where = f" (sequence {bad_seq.value})" if bad_seq.value >= 0 else ""
        raise ValueError(f"paged_attention: {_ERRORS.get(rc, f'error {rc}')}{where}")


def _checked_sizes(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out
) -> tuple[int, ...]:
    """The sizes and strides the C code takes, after checking everything that would make it
    read or write out of bounds short of the int tensors' values (it checks those itself).

    Each shape and stride is read once: on a ~10 us call every torch attribute access counts.
    """
    _check_dtypes_and_device(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    q_shape, q_stride, out_stride, cache_shape = q.shape, q.stride(), out.stride(), k_cache.shape
    v_shape, v_stride = v_cache.shape, v_cache.stride()
    _check_query_and_out(q_shape, q_stride, out.shape, out_stride, v_shape)
    _check_caches(k_cache, cache_shape, v_shape, v_stride, q_shape[2])
    batch, table_shape, table_stride = _checked_index_tensors(
        block_tables, seq_lens, query_start_loc
    )
    return (
        q_stride[0],
        q_stride[1],
        out_stride[0],
        out_stride[1],
        cache_shape[0],
        table_stride[0],
        table_shape[1],
        batch,
        q_shape[0],
        q_shape[1],
        cache_shape[1],
        q_shape[2],
        v_stride[0],
        v_shape[2],
    )


def _check_dtypes_and_device(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out):
    dtype = q.dtype
    if dtype not in _DTYPES or not (dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        raise ValueError(
            f"paged_attention: q, caches and out must share a dtype in "
            f"{list(_DTYPES)}; got {dtype}, {k_cache.dtype}, {v_cache.dtype}, "
            f"{out.dtype}"
        )
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    if not all(t.is_cpu for t in tensors):
        raise ValueError("paged_attention: every tensor must be on the CPU")


def _check_query_and_out(q_shape, q_stride, out_shape, out_stride, v_shape) -> None:
    if (
        len(q_shape) != 3
        or len(v_shape) != 3
        or out_shape != (*q_shape[:2], v_shape[2])
        or q_stride[2] != 1
        or out_stride[2] != 1
    ):
        raise ValueError(
            f"paged_attention: q must be [T, H, D] and out [T, H, Dv] with contiguous D and "
            f"Dv; got {tuple(q_shape)} and {tuple(out_shape)}"
        )


def _check_caches(k_cache, cache_shape, v_shape, v_stride, head_dim) -> None:
    if (
        len(cache_shape) != 3
        or cache_shape[2] != head_dim
        or not k_cache.is_contiguous()
        or v_shape[:2] != cache_shape[:2]
        or v_shape[2] > cache_shape[2]
        or v_stride[2] != 1
        or (v_shape[1] > 1 and v_stride[1] != v_shape[2])
    ):
        raise ValueError(
            f"paged_attention: k_cache must be contiguous [num_slots, KVH, {head_dim}] and "
            f"v_cache [num_slots, KVH, Dv <= {head_dim}] with contiguous heads; got "
            f"{tuple(cache_shape)} and {tuple(v_shape)}"
        )


def _checked_index_tensors(block_tables, seq_lens, query_start_loc) -> tuple[int, tuple, tuple]:
    # -> (batch, block_tables' shape, its strides), read once
    (batch,), table_shape, table_stride = seq_lens.shape, block_tables.shape, block_tables.stride()
    if (
        block_tables.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or query_start_loc.dtype != torch.int32
        or len(table_shape) != 2
        or table_shape[0] != batch
        or table_stride[1] != 1
        or not (seq_lens.is_contiguous() and query_start_loc.is_contiguous())
        or query_start_loc.shape != (batch + 1,)
    ):
        raise ValueError(
            "paged_attention: block_tables [B, W], seq_lens [B] and "
            "query_start_loc [B + 1] must be int32 with contiguous rows"
        )
    return batch, table_shape, table_stride


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = load_library(_SOURCE)
    except Exception as e:  # is_available() must never raise: whatever broke, say so and go on
        logger.warning("CPU paged-attention kernel unavailable: %s", e)
        return None
    fn = lib.raylane_paged_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    # pointers (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out), then
    # _checked_sizes(), then block_size, scale, dtype, num_threads, window, sinks, aligned,
    # bad_seq
    fn.argtypes = (
        [ptr] * 7
        + [i64] * 6
        + [i32] * 6
        + [i64, i32]
        + [i32, ctypes.c_float, i32, i32, i32, ptr, i32, ctypes.POINTER(ctypes.c_int)]
    )
    fn.restype = ctypes.c_int
    return lib
