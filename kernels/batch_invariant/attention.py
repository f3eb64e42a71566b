"""A trainer's attention through the engine's C paged kernel (on CUDA: the Triton kernels, each
row a one-split decode, triton_attention.py), so that its forward of a rollout reduces in the
order the engine's did (`raylane.batch_invariant()` installs it as transformers' "sdpa" and
"eager" attention).

The padded batch becomes what the engine sees: each sequence's valid rows packed one after
another, its keys and values laid into a paged cache of BLOCK_SIZE-slot blocks. The kernel's
order of work per query row does not depend on the rows around it, so row i of sequence b gives
bit for bit what the engine gave for that token. The backward pass recomputes the attention in
plain torch ops (float32) and differentiates that: gradients agree with transformers' own
within float tolerance, they are not batch-invariant.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from raylane.kernels.attention import cpu_kernel
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.grads import recomputed_grads

BLOCK_SIZE = 16  # slots per block, as the engine's default `block_size`


def invariant_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key / value
    [B, KVH, T, D(v)], a causal mask with right padding (bool, or additive float), or None
    for unpadded causal attention -> ([B, T, H, Dv], None)."""
    if dropout:
        raise ValueError(
            "raylane.batch_invariant: attention dropout must be 0 (call model.eval(), or set "
            "attention_dropout=0): dropped weights cannot equal the rollout's"
        )
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    sinks = kwargs.get("s_aux")  # gpt-oss: [H], one logit per head in every softmax
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    lengths = _lengths(attention_mask, query.shape[0], query.shape[2], key.shape[2], window)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _PagedAttention.apply(query, key, value, sinks, lengths, float(scale), window)
    return out, None


def _lengths(
    mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, window: int | None = None
) -> list[int]:
    """Each sequence's valid length, from a causal mask with right padding, sliding over
    `window` keys if given (ValueError for any other mask: left padding, packed sequences, a
    prefix of cached keys)."""
    if q_len != kv_len:
        raise ValueError(
            "raylane.batch_invariant: the forward must see the whole sequence (teacher "
            f"forcing, no KV cache); got {q_len} queries over {kv_len} keys"
        )
    if mask is None:
        return [q_len] * batch
    allowed = mask if mask.dtype == torch.bool else mask == 0  # [B, 1 | H, T, T]
    allowed = allowed[:, 0]
    rows = torch.arange(q_len, device=mask.device)
    lengths = allowed.diagonal(dim1=-2, dim2=-1).sum(-1)  # [B]: a query sees itself
    causal = _visible(rows, window)  # [T, T]
    want = causal[None] & (rows[None, None, :] < lengths[:, None, None])
    valid_rows = rows[None, :, None] < lengths[:, None, None]
    if not torch.equal(allowed & valid_rows, want & valid_rows):
        raise ValueError(
            "raylane.batch_invariant: the attention mask must be causal with right padding "
            "(padding_side='right'); left padding and packed sequences are not covered"
        )
    return lengths.tolist()


def _visible(rows: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, T]: query i sees key j (causal, and within its last `window` keys if given)."""
    causal = rows[None, :] <= rows[:, None]
    return causal if window is None else causal & (rows[None, :] > rows[:, None] - window)


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, lengths: list[int], scale: float, window: int | None):
        ctx.save_for_backward(q, k, v, sinks)
        ctx.lengths, ctx.scale, ctx.window = lengths, scale, window
        return paged(q, k, v, lengths, scale, window, sinks)

    @staticmethod
    def backward(ctx, grad):
        def attention(q, k, v, sinks):
            return reference(q, k, v, ctx.lengths, ctx.scale, ctx.window, sinks)

        taken = recomputed_grads(attention, ctx.saved_tensors, [grad])
        return (*taken, None, None, None)


def paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, T, D], k / v [B, KVH, T, D(v)] -> [B, T, H, Dv] through the C kernel (the
    Triton decode on CUDA); rows past a sequence's length are zero; a `window`: each query
    sees its last `window` keys; `sinks` [H]: per-head logits joining each softmax's
    denominator (gpt-oss)."""
    batch, heads, t, _ = q.shape
    tables, firsts = contiguous_tables(lengths)
    k_cache = _paged_cache(k, lengths, firsts, tables)  # [slots, KVH, D]
    v_cache = _paged_cache(v, lengths, firsts, tables)
    rows = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])  # [N, H, D]
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if on_triton(q.device):  # the engine's mode on CUDA: each row a one-split Triton decode
        from raylane.kernels.batch_invariant.triton_attention import attend_as_decodes

        out = attend_as_decodes(
            rows.contiguous(), k_cache, v_cache, tables, starts, scale, BLOCK_SIZE, window, sinks
        )
    else:
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        out = attend(
            rows.contiguous(), k_cache, v_cache, tables, seq_lens, starts, scale, window, sinks
        )
    full = out.new_zeros(batch, t, heads, v.shape[-1])
    for b, n in enumerate(lengths):
        full[b, :n] = out[starts[b] : starts[b] + n]
    return full


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C kernel over caches of BLOCK_SIZE-slot blocks (cpu_kernel.paged_attention's
    arguments): q [N, H, D] -> [N, H, Dv], rows past query_start_loc[-1] zero. A `window`'s
    key chunks align as in the engine's mode, so a row reduces as the engine's did."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    return cpu_kernel.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, out,
        block_size=BLOCK_SIZE, window=window, sinks=sinks, aligned=True,
    )  # fmt: skip


def contiguous_tables(lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Block tables [B, W] int32 for sequences of `lengths` laid one after another in
    BLOCK_SIZE-slot blocks, and each sequence's first slot."""
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lengths]
    tables = torch.zeros(len(lengths), max(max(blocks, default=0), 1), dtype=torch.int32)
    firsts, first = [], 0
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        firsts.append(first * BLOCK_SIZE)
        first += n
    return tables, firsts


def _num_slots(tables: torch.Tensor) -> int:
    return (int(tables.max()) + 1) * BLOCK_SIZE


def _paged_cache(
    x: torch.Tensor, lengths: list[int], firsts: list[int], tables: torch.Tensor
) -> torch.Tensor:
    """x [B, KVH, T, D] -> the slots of each sequence's blocks, [slots, KVH, D]: sequence b's
    token j at slot firsts[b] + j."""
    cache = x.new_zeros(_num_slots(tables), x.shape[1], x.shape[3])
    for b, (n, first) in enumerate(zip(lengths, firsts)):
        cache[first : first + n] = x[b, :, :n].transpose(0, 1)
    return cache


def repage(
    cache: torch.Tensor, block_tables: torch.Tensor, lengths: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's context in an engine's paged cache [num_slots, ...] (read through its
    `block_tables` row, `block_size` slots a block) copied into a fresh cache laid out as
    `contiguous_tables(lengths)`: (rows [slots, ...], zero where no token; tables [B, W])."""
    tables, firsts = contiguous_tables(lengths)
    src, dst = [], []
    for b, (n, first) in enumerate(zip(lengths, firsts)):
        j = torch.arange(n)
        src.append(block_tables[b, j // block_size].long() * block_size + j % block_size)
        dst.append(first + j)
    rows = cache.new_zeros(_num_slots(tables), *cache.shape[1:])
    if src:
        rows[torch.cat(dst)] = cache[torch.cat(src)]
    return rows, tables


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain torch ops, float32 (differentiable): [B, T, H, Dv]."""
    _, heads, t, _ = q.shape
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, T, T]
    rows = torch.arange(t, device=q.device)
    n = torch.tensor(lengths, device=q.device)[:, None, None, None]
    keep = _visible(rows, window)[None, None] & (rows < n)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], -1)
    probs = scores.softmax(-1).nan_to_num(0.0)[..., :t]
    out = (probs @ vf) * (rows[None, None, :, None] < n)  # padded rows: zero
    return out.transpose(1, 2).to(q.dtype)
