"""Pieces the Triton paged-attention kernels share: the jitted tile helpers (gathered K/V rows,
the online softmax step, sinks, windows) and the host's tile choices and shape checks.

See triton_kernels.py for the cache layout every kernel reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # softmax runs in base 2: exp(x) == exp2(x * LOG2E)
_PREFILL_BLOCK_M = 64  # (query token, query head) rows per prefill program
# the query, key and value tiles of one program, by the estimate rows x padded row bytes: an
# sm_90 program may have 227 KiB, and Triton's staging takes up to ~1.5x the estimate in 16 bits
_SHARED_BYTES = 160 * 1024
_MIN_SPLIT_TOKENS = 256  # a decode split shorter than this costs more to reduce than it saves
_MAX_SPLITS = 16


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # the interpreter (triton 3.9) multiplies bf16 bit patterns as integers; bf16 products
        # are exact in float32, so the upcast changes nothing but the summation order
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _slots(table_row, pos, pos_ok, BLOCK_SIZE: tl.constexpr):
    # [N] int64 cache slot of each context position; masked positions read no table entry
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _load_rows(cache, slots, stride_slot, head_offset, d, ok):
    # [N, D_PAD] rows of one KV head; masked rows and padded dims read as 0 (never garbage)
    return tl.load(
        cache + slots[:, None] * stride_slot + head_offset + d[None, :], mask=ok, other=0.0
    )


@triton.jit
def _load_kv_tile(
    k_cache,
    v_cache,
    table,
    pos,
    pos_ok,
    d,
    d_ok,
    dv_ok,
    stride_ks,
    stride_vs,
    kv_off_k,
    kv_off_v,
    BLOCK_SIZE: tl.constexpr,
):
    # the K and V rows [BLOCK_N, D_PAD] of context positions `pos`, through the block table;
    # V's dims past v_dim read as 0, so the output's are 0 and never stored
    slots = _slots(table, pos, pos_ok, BLOCK_SIZE)
    k = _load_rows(k_cache, slots, stride_ks, kv_off_k, d, pos_ok[:, None] & d_ok[None, :])
    v = _load_rows(v_cache, slots, stride_vs, kv_off_v, d, pos_ok[:, None] & dv_ok[None, :])
    return k, v


@triton.jit
def _softmax_step(
    q, k, v, visible, m, total, acc, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr
):
    # online softmax over one key tile. q [M, D_PAD], k/v [N, D_PAD], visible [M, N] or [1, N];
    # m [M] running max of the base-2 scores, total [M] running sum of exp2(score - m),
    # acc [M, D_PAD] float32 running sum of weighted values.
    # A row that has seen no key yet (a window starts after this tile) keeps m = -inf and sums
    # nothing: its shift is 0, so exp2(-inf - 0) gives 0 weights, never nan.
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m - shift)  # rescales what was summed under the old max
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _sink_mass(sinks, heads, heads_ok, m, HAS_SINKS: tl.constexpr):
    # exp2 of each row's sink logit (base 2, under the running max m): a sink joins the
    # softmax's denominator and adds nothing to the sum; 0 without sinks
    if HAS_SINKS:
        sink = tl.load(sinks + heads, mask=heads_ok, other=float("-inf")).to(tl.float32)
        return tl.exp2(sink * 1.4426950408889634 - m)
    else:
        return tl.zeros_like(m)


@triton.jit
def _window_start(first_query_pos, window):
    # the first key position the earliest query sees (window 0: no window, position 0)
    return tl.where(window > 0, tl.maximum(first_query_pos - window + 1, 0), 0)


def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 for 16-bit inputs


def _tiles(d_pad: int, q: torch.Tensor) -> dict[str, int]:
    # keys per loop step and warps per program. Every K/V element has its own int64 pointer (the
    # slots are gathered), so wide rows need fewer keys or more warps; these keep ptxas from
    # spilling on sm_90 (checked by compiling ahead of time, not timed on a GPU). MLA's latent
    # rows (576 wide, padded to 1024) take 16 keys a step
    row_bytes = d_pad * q.element_size()
    block_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 1024 else 16
    return {"BLOCK_N": block_n, "num_warps": 4 if row_bytes < 128 else 8}


def _rows_per_program(wanted: int, block_n: int, d_pad: int, q: torch.Tensor) -> int:
    """Query rows (token x head) one program holds: `wanted`, halved while its query tile and
    the key and value tiles would overflow the shared-memory budget, never under 16 (tl.dot's
    least M). The first H100 run failed MLA's prefill here: 64 rows of 1024 float32 lanes asked
    for 520 KiB against the 227 KiB an sm_90 program may have."""
    rows, row_bytes = wanted, d_pad * q.element_size()
    while rows > 16 and (rows + 2 * block_n) * row_bytes > _SHARED_BYTES:
        rows //= 2
    return rows


def _program_shape(
    group: int, d_pad: int, q: torch.Tensor, least_rows: int
) -> tuple[dict[str, int], int, int, int]:
    """(tiles, rows, heads, chunks) of one program: keys per step and warps (`_tiles`); the
    (token x head) rows it holds, at least `least_rows` and the group's power of two, shrunk to
    the shared-memory budget; the query heads it takes; and the programs a KV head's group of
    `group` query heads splits into."""
    tiles = _tiles(d_pad, q)
    wanted = max(least_rows, triton.next_power_of_2(group))
    rows = _rows_per_program(wanted, tiles["BLOCK_N"], d_pad, q)
    heads = min(group, rows)
    return tiles, rows, heads, triton.cdiv(group, heads)


def _dot_mode(q: torch.Tensor) -> dict[str, object]:
    # float32 inputs get exact products (tf32 would cost ~1e-3); 16-bit inputs ignore PRECISION.
    # CPU tensors mean the interpreter, whose bf16 tl.dot is broken (see _dot).
    return {
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": q.dtype == torch.bfloat16 and q.device.type == "cpu",
    }


def _check_paged(q, k_cache, v_cache, out, block_size: int) -> tuple[int, int, int, int]:
    """Shapes of a paged attention call -> (num_heads, num_kv_heads, head_dim, v_dim)."""
    _require_unit_last_stride(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    v_dim = v_cache.shape[2]
    if (
        k_cache.shape[2] != head_dim
        or v_cache.shape[:2] != k_cache.shape[:2]
        or v_dim > head_dim
        or out.shape != (*q.shape[:2], v_dim)
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}, out {tuple(out.shape)}"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    return num_heads, num_kv_heads, head_dim, v_dim


@dataclass(frozen=True)
class _PagedCall:
    """One paged attention call, checked, with what both kernels are launched with: the six
    tensors they open with, the sinks pointer, the strides and the constexprs of a program."""

    tensors: tuple[torch.Tensor, ...]  # q, k_cache, v_cache, out, block_tables, seq_lens
    sinks: torch.Tensor  # q when there are none: any pointer does
    num_heads: int
    num_kv_heads: int
    rows: int  # (token x head) rows per program: decode's G_PAD, prefill's BLOCK_M
    heads: int  # the query heads of one program
    chunks: int  # the programs a KV head's group of query heads splits into
    constants: dict[str, object]  # GROUP .. HAS_SINKS, BLOCK_N, num_warps and the dot mode

    @classmethod
    def checked(
        cls,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sinks: torch.Tensor | None,
        block_size: int,
        least_rows: int,
    ) -> _PagedCall:
        num_heads, num_kv_heads, head_dim, v_dim = _check_paged(
            q, k_cache, v_cache, out, block_size
        )
        group, d_pad = num_heads // num_kv_heads, _padded_head_dim(head_dim)
        tiles, rows, heads, chunks = _program_shape(group, d_pad, q, least_rows)
        constants = {
            "GROUP": group,
            "HEADS": heads,
            "NUM_CHUNKS": chunks,
            "HEAD_DIM": head_dim,
            "V_DIM": v_dim,
            "D_PAD": d_pad,
            "BLOCK_SIZE": block_size,
            "HAS_SINKS": sinks is not None,
            **tiles,
            **_dot_mode(q),
        }
        tensors = (q, k_cache, v_cache, out, block_tables, seq_lens)
        pointer = q if sinks is None else sinks
        return cls(tensors, pointer, num_heads, num_kv_heads, rows, heads, chunks, constants)

    @property
    def q(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def out(self) -> torch.Tensor:
        return self.tensors[3]

    def strides(self) -> tuple[int, ...]:
        # read at launch: the row and head strides of q, the caches and out, block_tables' rows
        q, k_cache, v_cache, out, block_tables, _ = self.tensors
        return (*_row_head_strides(q, k_cache, v_cache, out), block_tables.stride(0))


def _row_head_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(stride for t in tensors for stride in t.stride()[:2])


def _require_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 3 or (t.shape[2] > 1 and t.stride(2) != 1):
            raise ValueError(
                f"{name} must be [rows, heads, head_dim] with head_dim contiguous, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
