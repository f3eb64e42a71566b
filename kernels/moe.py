"""Mixture-of-experts: top-k routing and the expert compute, returning the chosen expert ids.

Routing follows HF Qwen3-MoE / Mixtral: softmax over all experts in float32, top-k, then
optionally renormalise the k weights to sum to one (`norm_topk_prob`). The expert compute loops
over the experts that received tokens (never over tokens) and accumulates in expert order.
"""

from __future__ import annotations

import torch

from kernels.activation import act_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def expert_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """Weighted sum of each token's experts.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    weights / ids [T, k] -> [T, H].
    """
    top_k = ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = ids.view(-1)  # [T * k], entry j is token j // k
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        entries = order[start:start + count]  # [n] indexes into the flat (token, slot) grid
        start += count
        tokens = entries // top_k
        h = torch.nn.functional.linear(x.index_select(0, tokens), w13[expert])  # [n, 2I]
        h = torch.nn.functional.linear(act_and_mul(h, hidden_act), w2[expert])  # [n, H]
        out.index_add_(0, tokens, h * flat_weights.index_select(0, entries).unsqueeze(1))
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool,
              hidden_act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Route and compute: (out [T, H], chosen expert ids [T, k] int32)."""
    weights, ids = select_experts(router_logits, top_k, renormalize)
    out = expert_forward(x, w13, w2, weights, ids, hidden_act)
    return out, ids.to(torch.int32)
