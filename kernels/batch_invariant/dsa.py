"""A trainer's DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on the engine's batch-invariant
numerics: `raylane.batch_invariant()` installs `dsa_attention_forward` as the `forward` of
transformers' DeepseekV32Attention and GlmMoeDsaAttention.

transformers scores the indexer with batched matmuls over the whole padded batch, takes
`torch.topk`'s pick and attends in MLA's expanded form under a sparse mask. The engine's mode
(kernels/attention/sparse.py) scores each token on its own, keeps the top-k by a stable sort,
and attends the chosen positions in MLA's absorbed form, each head's matmuls row-invariant. Here
the trainer's projections, norms and RoPE stay transformers' own; from the query and the
latent row on, every valid token of the padded batch runs the engine's very functions
(`select_topk`, `sparse_latent_attention`) over a paged copy of its sequence, so its output
equals the engine's bit for bit. Autograd flows through the attention (the selection, as in
transformers, carries none). On CUDA those functions take their Triton form by the tensors'
device (`on_triton`: triton_dsa.py's per-token matmul and row-wise softmax), as the engine's.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.sparse import select_topk, sparse_latent_attention
from raylane.kernels.batch_invariant.attention import BLOCK_SIZE, _lengths, contiguous_tables
from raylane.kernels.batch_invariant.linear import padded_linear

# the indexer's RoPE in each modeling file: V3.2 rotates half-split, GLM-5 interleaved pairs
_INDEXER_ROPE = {
    "DeepseekV32Indexer": "apply_rotary_pos_emb",
    "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave",
}


def dsa_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,  # [B, T, D]
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[Any, ...]:
    """transformers' DSA attention forward (GLM-5's returns the chosen positions too, which its
    "shared" layers take as `prev_topk_indices`)."""
    cache = cache if cache is not None else kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length(self.layer_idx) > 0:
        raise ValueError(
            "raylane.batch_invariant: the forward must see the whole sequence (teacher forcing, "
            "no KV cache holding earlier tokens)"
        )
    batch, t = hidden_states.shape[:2]
    lengths = _lengths(attention_mask, batch, t, t)
    paged = _Paged(lengths, hidden_states.device)
    hf = sys.modules[type(self).__module__]
    cos, sin = position_embeddings
    nope, rank = self.qk_nope_head_dim, self.kv_lora_rank
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [B, T, q_lora_rank]
    kv_b = self.kv_b_proj.weight.view(self.num_heads, nope + self.v_head_dim, rank)
    query, row = _absorbed(self, hf, hidden_states, q_resid, kv_b, position_embeddings, paged)
    if self.indexer is not None:
        chosen = _select(self.indexer, hf, hidden_states, q_resid, cos, sin, paged)
    elif prev_topk_indices is None:
        raise ValueError("a shared DSA layer needs the top-k of a full indexer layer before it")
    else:
        chosen = prev_topk_indices
    out = sparse_latent_attention(
        query, paged.cache(row), rank, chosen, paged.meta, self.scaling, invariant=True
    )  # [N, H, L]
    out = _per_head(out, kv_b[:, nope:])  # [N, H, v]
    out = self.o_proj(paged.unpack(out.flatten(1), t))  # [B, T, D]
    return (out, None, chosen) if hasattr(self, "skip_topk") else (out, None)


def _absorbed(
    self: Any,
    hf: Any,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    kv_b: torch.Tensor,  # [H, nope + v, L]: kv_b_proj's weight per head
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    paged: _Paged,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's absorbed form, packed over the valid tokens: the query [N, H, L + R] (the no-RoPE
    part through kv_b's key half into the latent) and the latent row [N, 1, L + R] the cache
    holds."""
    batch, t = hidden_states.shape[:2]
    nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    q = self.q_b_proj(q_resid).view(batch, t, self.num_heads, nope + rope)
    q_nope, q_rot = q.split([nope, rope], dim=-1)
    kv_pass, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(
        q_rot, k_rot[:, :, None], cos, sin, unsqueeze_dim=2
    )
    q_latent = _per_head(paged.pack(q_nope), kv_b[:, :nope].transpose(1, 2))  # [N, H, L]
    query = torch.cat([q_latent, paged.pack(q_rot)], dim=-1)  # [N, H, L + R]
    row = torch.cat([paged.pack(self.kv_a_layernorm(kv_pass))[:, None], paged.pack(k_rot)], -1)
    return query, row


def _select(
    indexer: Any,
    hf: Any,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    paged: _Paged,
) -> torch.Tensor:
    """The indexer's projections as transformers computes them, then the engine's selection:
    [N, index_topk] positions, ascending, -1 padded."""
    name = _INDEXER_ROPE.get(type(indexer).__name__)
    if name is None:
        raise ValueError(f"raylane.batch_invariant: {type(indexer).__name__} is not covered")
    batch, t = hidden.shape[:2]
    heads, dim, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, t, heads, dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, T, 1, D]
    (q_rot, q_pass), (k_rot, k_pass) = (x.split([rope, dim - rope], dim=-1) for x in (q, k))
    q_rot, k_rot = getattr(hf, name)(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
    weights = indexer.weights_proj(hidden).float() * heads**-0.5  # [B, T, nh]
    keys = paged.cache(paged.pack(k))  # [slots, 1, D]
    return select_topk(
        paged.pack(q), paged.pack(weights), keys, paged.meta, indexer.index_topk,
        indexer.softmax_scale, invariant=True,
    )  # fmt: skip


def _per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, H, in], weight [H, out, in] -> [N, H, out]: each head through `padded_linear` with
    a contiguous weight, as the engine's absorbed MLA in the mode (mla.per_head_linear)."""
    return torch.stack(
        [padded_linear(x[:, h], weight[h].contiguous()) for h in range(weight.shape[0])], dim=1
    )


class _Paged:
    """A right-padded batch's valid tokens packed one sequence after another, and the engine's
    metadata for them as one prefill each, laid out in BLOCK_SIZE-slot blocks."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        tables, firsts = contiguous_tables(lengths)
        starts = [0, *itertools.accumulate(lengths)]
        slots = [torch.arange(f, f + n) for f, n in zip(firsts, lengths)]
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        self.meta = AttentionMetadata(  # on the model's device: the ops index with it
            slot_mapping=slot_mapping.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            num_prefills=len(lengths),
            num_prefill_tokens=starts[-1],
            max_query_len=max(lengths, default=0),
            max_seq_len=max(lengths, default=0),
            block_size=BLOCK_SIZE,
        )
        self.num_slots = (int(tables.max()) + 1) * BLOCK_SIZE

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> [N, ...], each sequence's valid rows."""
        return torch.cat([x[b, :n] for b, n in enumerate(self.lengths)])

    def unpack(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """x [N, ...] -> [B, t, ...], padded rows zero."""
        parts = x.split(self.lengths)
        return torch.stack([torch.nn.functional.pad(p, (0, 0, 0, t - p.shape[0])) for p in parts])

    def cache(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, 1, W] -> a paged cache [slots, 1, W] holding them at their slots."""
        empty = rows.new_zeros(self.num_slots, *rows.shape[1:])
        return empty.index_copy(0, self.meta.slot_mapping, rows)
