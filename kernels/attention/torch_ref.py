"""Reference attention in plain torch: runs on CPU and GPU, and is the ground truth in tests.

It gathers each sequence's context from the paged cache into a padded batch, then runs SDPA
with a boolean mask. Prefills are planned on the host once per step (by the first layer);
decodes use only device ops on the metadata's tensors, so a decode step replays from a
captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from raylane.kernels.attention.metadata import AttentionMetadata, SeqSlice


@dataclass
class PrefillPlan:
    """The prefill chunks laid out padded: `flat_index` scatters their flat tokens into the
    `[batch, max_q]` query grid."""

    num_tokens: int
    max_q: int
    flat_index: torch.Tensor  # [num_tokens] int64 into batch * max_q
    gather_slots: torch.Tensor  # [batch, max_ctx] int64 KV slots of every context position
    allowed: torch.Tensor  # [batch, 1, max_q, max_ctx] bool: query may attend key
    # every chunk starts at position 0: causal attention over the step's own K/V, no gather
    fresh: bool
    q_pos: torch.Tensor | None = None  # [batch, max_q] int64 each query's position
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its `allowed`

    def allowed_in(self, window: int | None) -> torch.Tensor:
        """`allowed`, narrowed to the last `window` keys of each query (itself included)."""
        if window is None:
            return self.allowed
        if window not in self.windowed:
            assert self.q_pos is not None
            k_pos = torch.arange(self.allowed.shape[-1], device=self.allowed.device)
            recent = k_pos.view(1, 1, -1) > (self.q_pos - window).unsqueeze(-1)
            self.windowed[window] = self.allowed & recent.unsqueeze(1)
        return self.windowed[window]

    @property
    def batch(self) -> int:
        return self.gather_slots.shape[0]


class TorchAttention:
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> PrefillPlan | None:
        if not meta.num_prefills:
            return None
        if meta.seqs is None:
            raise ValueError("attention metadata with prefills needs its host-side `seqs`")
        return plan_prefill(
            meta.seqs[: meta.num_prefills], meta.block_size, meta.slot_mapping.device
        )

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
        window: int | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0,
    ):  # fmt: skip
        """`window`: a query sees only its last `window` keys (itself included); `sinks` [H]:
        one learned logit per head that joins each softmax's denominator (gpt-oss); `softcap`
        > 0: each logit becomes cap * tanh(s / cap) (Gemma 2, the layer kind "softcap")."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])  # [T, H, Dv]
        split = meta.num_prefill_tokens
        if meta.num_prefills:
            if meta.plan is None:  # planned by the first layer, shared by the rest
                meta.plan = self.plan(meta)
            prefill: PrefillPlan = meta.plan
            rows = slice(0, split)
            if prefill.fresh and window is None and sinks is None and not softcap:
                out[rows] = attend_fresh(q[rows], k[rows], v[rows], prefill, scale)
            else:
                out[rows] = attend_prefill(
                    q[rows], k_cache, v_cache, prefill, scale, window, sinks, softcap
                )
        if meta.num_decodes:
            first = meta.num_prefills
            out[split:] = attend_decode(
                q[split:],
                k_cache,
                v_cache,
                meta.block_tables[first:],
                meta.seq_lens[first:],
                meta.block_size,
                scale,
                window,
                sinks,
                softcap,
            )
        return out


def store_kv(k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def plan_prefill(seqs: list[SeqSlice], block_size: int, device) -> PrefillPlan:
    batch = len(seqs)
    max_q = max(s.num_new for s in seqs)
    max_ctx = max(s.context_len for s in seqs)
    blocks = torch.zeros(batch, -(-max_ctx // block_size), dtype=torch.long)
    for i, s in enumerate(seqs):
        used = -(-s.context_len // block_size)
        blocks[i, :used] = torch.tensor(s.block_table[:used], dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    gather = (blocks.unsqueeze(-1) * block_size + offsets).view(batch, -1)[:, :max_ctx]
    ctx = torch.tensor([s.context_len for s in seqs], dtype=torch.long)
    num_new = torch.tensor([s.num_new for s in seqs], dtype=torch.long)
    # query i of a sequence sits at position context_len - num_new + i and sees keys <= it
    q_pos = (ctx - num_new).unsqueeze(1) + torch.arange(max_q).unsqueeze(0)  # [batch, max_q]
    k_pos = torch.arange(max_ctx).view(1, 1, max_ctx)
    allowed = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < ctx.view(-1, 1, 1))
    flat_index = torch.cat([torch.arange(s.num_new) + i * max_q for i, s in enumerate(seqs)])
    fresh = all(s.num_new == s.context_len for s in seqs)
    return PrefillPlan(
        int(num_new.sum()),
        max_q,
        flat_index.to(device),
        gather.contiguous().to(device),
        allowed.unsqueeze(1).to(device),
        fresh,
        q_pos.to(device),
    )


def attend_prefill(
    q, k_cache, v_cache, plan: PrefillPlan, scale: float, window=None, sinks=None, softcap=0.0
) -> torch.Tensor:
    num_heads, v_dim = q.shape[1], v_cache.shape[2]
    qp = _pad(q, plan, q.new_empty)  # padded query rows are never read back
    # index_select on the flat slot list is several times faster than advanced indexing on CPU
    slots = plan.gather_slots.view(-1)
    ctx_shape = (plan.batch, plan.gather_slots.shape[1], k_cache.shape[1], -1)
    # [batch, max_ctx, num_kv_heads, D] -> [batch, num_kv_heads, max_ctx, D]
    kp = k_cache.index_select(0, slots).view(ctx_shape).transpose(1, 2)
    vp = v_cache.index_select(0, slots).view(ctx_shape).transpose(1, 2)
    out = attend(qp.transpose(1, 2), kp, vp, plan.allowed_in(window), scale, sinks, softcap)
    out = out.transpose(1, 2).reshape(plan.batch * plan.max_q, num_heads, v_dim)
    return out.index_select(0, plan.flat_index)


def attend_fresh(q, k, v, plan: PrefillPlan, scale: float) -> torch.Tensor:
    """Prefills that start at position 0: causal attention over the step's own K/V.

    For a real query i every key j <= i is real, so the padding never needs a mask; padded K/V
    rows are zeros so that no garbage (nan) can meet a zero attention weight.
    """
    qp = _pad(q, plan, q.new_empty)
    kp, vp = _pad(k, plan, k.new_zeros), _pad(v, plan, v.new_zeros)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # [batch, num_heads, max_q, head_dim]
    out = out.transpose(1, 2).reshape(-1, q.shape[1], v.shape[2])
    return out.index_select(0, plan.flat_index)


def attend_decode(
    q,
    k_cache,
    v_cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence over its whole context, from device tensors only (capturable):
    every block of the table is gathered, positions past `seq_lens` (and, with a window,
    before its start) masked out."""
    batch, width = block_tables.shape
    num_heads, kv_heads, v_dim = q.shape[1], k_cache.shape[1], v_cache.shape[2]
    blocks = block_tables.reshape(-1).long()
    ctx_shape = (batch, width * block_size, kv_heads, -1)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # the cache viewed as [num_blocks, block_size, KVH, D]: gather whole blocks
        blocked = cache.view(-1, block_size, kv_heads, cache.shape[2])
        return blocked.index_select(0, blocks).view(ctx_shape)

    kp, vp = gather(k_cache), gather(v_cache)
    positions = torch.arange(width * block_size, device=q.device)
    allowed = positions.unsqueeze(0) < seq_lens.unsqueeze(1)
    if window is not None:  # the query sits at seq_len - 1
        allowed &= positions.unsqueeze(0) >= (seq_lens - window).unsqueeze(1)
    out = attend(
        q.unsqueeze(1).transpose(1, 2),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        allowed.view(batch, 1, 1, -1),
        scale,
        sinks,
        softcap,
    )  # [batch, num_heads, 1, Dv]
    return out.view(batch, num_heads, v_dim)


def attend(
    q, k, v, allowed, scale: float, sinks: torch.Tensor | None, softcap: float = 0.0
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, KVH, K, D], allowed [B, 1, Q, K] -> [B, H, Q, Dv]. A sink adds
    exp(sink_h) to the softmax's denominator and nothing to the sum (so a row may weigh its
    keys at less than 1); a softcap bounds each logit to (-cap, cap) before the mask."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None and not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa
        )
    if gqa:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, -torch.inf)
    if sinks is None:
        return logits.softmax(dim=-1).to(v.dtype) @ v
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _pad(x: torch.Tensor, plan: PrefillPlan, alloc) -> torch.Tensor:
    """Flat rows [num_tokens, H, D] -> [batch, max_q, H, D] laid out per sequence."""
    padded = alloc(plan.batch * plan.max_q, x.shape[1], x.shape[2])
    padded.index_copy_(0, plan.flat_index, x)
    return padded.view(plan.batch, plan.max_q, x.shape[1], x.shape[2])
