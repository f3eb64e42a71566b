"""DeepSeek Sparse Attention (DSA) in plain torch: the lightning indexer's top-k selection over
a paged key cache, and MLA attention over the selected positions only.

Every token finds its sequence and position from the metadata's tensors alone (no host sync),
so a decode step replays from a captured graph. The reference gathers each token's whole
context of indexer keys ([T, context, D]): fine for tests and small contexts, not for 128k.

Tie rule: a token keeps the `topk` highest index scores among the positions it sees; between
equal scores the earlier position wins (a stable descending sort), so the selection is a
function of the scores alone. transformers takes `torch.topk`'s pick, which agrees unless
scores tie exactly at the boundary (e.g. positions where every head's ReLU is zero).

`invariant` (the batch-invariant mode): the batched matmuls span a context width set by the
batch's longest block table and a batch of every token in the step, and may reduce in an order
that follows either; there each token's matmuls run on their own (`padded_linear`, over the
positions it sees), so its scores, picks and output depend on that token alone. On CUDA
(`on_triton`) those matmuls run a Triton kernel with one order per token and the softmax one
order per row (kernels/batch_invariant/triton_dsa.py), with no host sync; torch.sort's stable
pick is already a function of a row's scores alone on either device.
"""

from __future__ import annotations

import torch
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.batch_invariant import padded_linear
from raylane.kernels.batch_invariant.backend import on_triton


def token_positions(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [T] int64, position [T] int64) of every token of the step."""
    qsl, num_tokens = meta.query_start_loc, meta.num_tokens
    tokens = torch.arange(num_tokens, device=qsl.device, dtype=qsl.dtype)
    seq = torch.searchsorted(qsl[1:], tokens, right=True).long()  # [T]
    ends = qsl[1:].long().index_select(0, seq)  # one past the sequence's last token
    return seq, meta.seq_lens.long().index_select(0, seq) - (ends - tokens.long())


def context_slots(meta: AttentionMetadata, seq: torch.Tensor) -> torch.Tensor:
    """[T, W * block_size] cache slots of every position of each token's sequence table."""
    tables = meta.block_tables.long().index_select(0, seq)  # [T, W]
    offsets = torch.arange(meta.block_size, device=tables.device)
    return (tables.unsqueeze(-1) * meta.block_size + offsets).flatten(1)


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    meta: AttentionMetadata,
    topk: int,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """The indexer's choice: q [T, nh, D], weights [T, nh] float32, key_cache [slots, 1, D]
    -> [T, topk] int64 positions, ascending, -1 where fewer than topk are visible.

    score(t, s) = sum_h weights[t, h] * relu(scale * q[t, h] . k[s]) over positions s <= t."""
    seq, pos = token_positions(meta)
    slots = context_slots(meta, seq)  # [T, C]
    if invariant and on_triton(q.device):
        scores = _scores_on_triton(q, weights, key_cache[:, 0], slots, scale)
    elif invariant:
        scores = _scores_per_token(q, weights, key_cache[:, 0], slots, pos, scale)
    else:
        keys = key_cache[:, 0].index_select(0, slots.flatten()).view(*slots.shape, -1)
        scores = torch.bmm(q.float(), keys.float().transpose(1, 2)) * scale  # [T, nh, C]
        scores = torch.bmm(weights.unsqueeze(1), scores.relu()).squeeze(1)  # [T, C]
    ctx = torch.arange(slots.shape[1], device=q.device)
    visible = ctx.unsqueeze(0) <= pos.unsqueeze(1)  # [T, C]
    scores = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = order.masked_fill(~visible.gather(1, order), -1)
    if chosen.shape[1] < topk:  # a context shorter than topk: pad the width
        chosen = torch.nn.functional.pad(chosen, (0, topk - chosen.shape[1]), value=-1)
    return _ascending(chosen)


def _scores_per_token(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """select_topk's scores [T, C], each token's from its own matmuls over positions 0..pos
    (shapes that token alone sets); positions past it are left 0 (select_topk masks them)."""
    scores = q.new_zeros(slots.shape, dtype=torch.float32)
    for t, p in enumerate(pos.tolist()):  # NOTE: a host sync; the mode runs on the CPU
        k = keys.index_select(0, slots[t, : p + 1]).float()  # [p + 1, D]
        heads = padded_linear(q[t].float(), k).mul(scale).relu()  # [nh, p + 1]
        scores[t, : p + 1] = padded_linear(weights[t : t + 1], heads.t().contiguous())[0]
    return scores


def _scores_on_triton(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """select_topk's scores [T, C] on the mode's CUDA path: each token's two matmuls in a
    Triton kernel of one order per token (triton_dsa.py), no host sync. A zero score is +0
    (a sum of ReLU zeros may be -0, which a radix sort, as CUDA's may be, ranks below +0; the
    CPU's sort ties them), so ties keep the earlier position on both devices."""
    from raylane.kernels.batch_invariant.triton_dsa import token_matmul

    gathered = keys.index_select(0, slots.flatten()).view(*slots.shape, -1).float()  # [T, C, D]
    heads = token_matmul(q.float(), gathered).mul(scale).relu()  # [T, nh, C]
    scores = token_matmul(weights.float().unsqueeze(1), heads.transpose(1, 2))[:, 0]  # [T, C]
    return torch.where(scores == 0, torch.zeros_like(scores), scores)


def _ascending(chosen: torch.Tensor) -> torch.Tensor:
    # positions ascending, the -1 padding last
    big = torch.iinfo(chosen.dtype).max
    ordered = torch.sort(chosen.masked_fill(chosen < 0, big), dim=-1).values
    return ordered.masked_fill(ordered == big, -1)


def sparse_latent_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_lora_rank: int,
    chosen: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """MLA's absorbed form over the chosen positions only: q [T, H, L + R], latent_cache
    [slots, 1, L + R], chosen [T, k] positions (-1 = none) -> [T, H, L]."""
    seq, _ = token_positions(meta)
    tables = meta.block_tables.long().index_select(0, seq)  # [T, W]
    valid = chosen >= 0
    pos = chosen.clamp(min=0)
    blocks = tables.gather(1, pos // meta.block_size)
    slots = blocks * meta.block_size + pos % meta.block_size  # [T, k]
    rows = latent_cache[:, 0].index_select(0, slots.flatten()).view(*slots.shape, -1)
    if invariant and on_triton(q.device):
        return _latent_on_triton(q, rows, kv_lora_rank, valid, scale)
    if invariant:
        return _latent_per_token(q, rows, kv_lora_rank, valid, scale)
    scores = torch.einsum("thd,tkd->thk", q, rows) * scale  # [T, H, k]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("thk,tkl->thl", probs, rows[..., :kv_lora_rank])


def _latent_per_token(
    q: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """sparse_latent_attention's math, each token's two matmuls on their own: [T, H, L]."""
    out = q.new_empty(*q.shape[:2], kv_lora_rank)
    for t in range(q.shape[0]):
        keys = rows[t].clone()  # [k, L + R], a fresh (aligned) copy as every token's weight
        scores = padded_linear(q[t], keys) * scale  # [H, k]
        scores = scores.masked_fill(~valid[t], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[t] = padded_linear(probs, keys[:, :kv_lora_rank].t().contiguous())
    return out


def _latent_on_triton(
    q: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """`_latent_per_token`'s math on the mode's CUDA path: the two matmuls per token in a
    Triton kernel of one order per token, the softmax one order per row (triton_dsa.py)."""
    from raylane.kernels.batch_invariant.triton_dsa import softmax, token_matmul

    scores = token_matmul(q, rows) * scale  # [T, H, k]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = softmax(scores).to(q.dtype)
    return token_matmul(probs, rows[..., :kv_lora_rank].transpose(1, 2))  # [T, H, L]
