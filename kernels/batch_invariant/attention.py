"""A trainer's attention through the engine's C paged kernel, so that its forward of a rollout
reduces in the order the engine's did (`raylane.batch_invariant()` installs it as transformers'
"sdpa" and "eager" attention).

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
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise ValueError(
            "raylane.batch_invariant: sliding-window attention is not covered; run the trainer "
            "without the context for this model"
        )
    lengths = _lengths(attention_mask, query.shape[2], key.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _PagedAttention.apply(query, key, value, lengths, float(scale))
    return out, None


def _lengths(mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[int]:
    """Each sequence's valid length, from a causal mask with right padding (ValueError for any
    other mask: left padding, packed sequences, a prefix of cached keys)."""
    if q_len != kv_len:
        raise ValueError(
            "raylane.batch_invariant: the forward must see the whole sequence (teacher "
            f"forcing, no KV cache); got {q_len} queries over {kv_len} keys"
        )
    if mask is None:
        return [q_len]  # every sequence: broadcast below
    allowed = mask if mask.dtype == torch.bool else mask == 0  # [B, 1 | H, T, T]
    allowed = allowed[:, 0]
    rows = torch.arange(q_len, device=mask.device)
    lengths = allowed.diagonal(dim1=-2, dim2=-1).sum(-1)  # [B]: a query sees itself
    causal = rows[None, :] <= rows[:, None]  # [T, T]
    want = causal[None] & (rows[None, None, :] < lengths[:, None, None])
    valid_rows = rows[None, :, None] < lengths[:, None, None]
    if not torch.equal(allowed & valid_rows, want & valid_rows):
        raise ValueError(
            "raylane.batch_invariant: the attention mask must be causal with right padding "
            "(padding_side='right'); left padding and packed sequences are not covered"
        )
    return lengths.tolist()


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lengths: list[int], scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.lengths, ctx.scale = lengths, scale
        return paged(q, k, v, lengths, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            out = reference(*inputs, ctx.lengths, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype)))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


def paged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    """q [B, H, T, D], k / v [B, KVH, T, D(v)] -> [B, T, H, Dv] through the C kernel; rows past a
    sequence's length are zero."""
    batch, heads, t, _ = q.shape
    lengths = lengths * batch if len(lengths) == 1 else lengths
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lengths]
    k_cache = _paged_cache(k, lengths, blocks)  # [slots, KVH, D]
    v_cache = _paged_cache(v, lengths, blocks)
    tables = torch.zeros(batch, max(max(blocks), 1), dtype=torch.int32)
    first = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    rows = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])  # [N, H, D]
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    out = rows.new_empty(rows.shape[0], heads, v.shape[-1])
    cpu_kernel.paged_attention(
        rows.contiguous(),
        k_cache,
        v_cache,
        tables,
        torch.tensor(lengths, dtype=torch.int32),
        starts,
        scale,
        out,
        block_size=BLOCK_SIZE,
    )
    full = out.new_zeros(batch, t, heads, v.shape[-1])
    for b, n in enumerate(lengths):
        full[b, :n] = out[starts[b] : starts[b] + n]
    return full


def _paged_cache(x: torch.Tensor, lengths: list[int], blocks: list[int]) -> torch.Tensor:
    """x [B, KVH, T, D] -> the slots of each sequence's blocks, [sum(blocks) * BLOCK_SIZE,
    KVH, D]: sequence b's token j at slot (its first block) * BLOCK_SIZE + j."""
    cache = x.new_zeros(max(sum(blocks), 1) * BLOCK_SIZE, x.shape[1], x.shape[3])
    slot = 0
    for b, (n, nb) in enumerate(zip(lengths, blocks)):
        cache[slot : slot + n] = x[b, :, :n].transpose(0, 1)
        slot += nb * BLOCK_SIZE
    return cache


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    """The same attention in plain torch ops, float32 (differentiable): [B, T, H, Dv]."""
    batch, heads, t, _ = q.shape
    lengths = lengths * batch if len(lengths) == 1 else lengths
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, T, T]
    rows = torch.arange(t, device=q.device)
    n = torch.tensor(lengths, device=q.device)[:, None, None, None]
    keep = (rows[None, None, None, :] <= rows[None, None, :, None]) & (rows < n)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    out = (probs @ vf) * (rows[None, None, :, None] < n)  # padded rows: zero
    return out.transpose(1, 2).to(q.dtype)
