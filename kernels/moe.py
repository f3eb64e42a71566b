"""Mixture-of-experts: top-k routing and the expert compute, returning the chosen expert ids.

Routing follows HF Qwen3-MoE / Mixtral: softmax over all experts in float32, top-k, then
optionally renormalise the k weights to sum to one (`norm_topk_prob`).

The expert compute never reads a tensor value on the host and has no Python loop over experts,
so decode can be captured in a CUDA graph: the (token, slot) entries are sorted by expert, each
expert's rows are one group of a grouped matmul whose group ends are computed on the device, and
each token sums its k results in ascending expert order, as HF's per-expert loop does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from raylane.kernels.activation import act_and_mul
from raylane.kernels.batch_invariant import grouped_linear
from raylane.kernels.batch_invariant.elementwise import sigmoid as invariant_sigmoid
from raylane.kernels.batch_invariant.elementwise import silu_and_mul

_MM_ALIGN_BYTES = 16  # torch._grouped_mm: start and leading stride of each operand


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def select_experts_topk_softmax(
    router_logits: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k of the logits, softmax over those k in the logits' dtype
    -> (weights [T, k], ids [T, k] int64)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def select_experts_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: router_logits [T, E] float32 -> (weights [T, k] float32, ids [T, k]).

    Sigmoid scores; the choice adds `correction_bias` [E] and is limited to the `topk_groups`
    of `num_groups` expert groups whose two best biased scores sum highest; the weights are the
    unbiased scores of the chosen experts (renormalised to sum to one when asked), times
    `scaling`. Device ops only. Ties go to `torch.topk`'s pick, as in HF.
    """
    # `invariant`: each row's sigmoid on one code path whatever T (the batch-invariant mode)
    scores = invariant_sigmoid(router_logits) if invariant else router_logits.sigmoid()
    biased = scores + correction_bias
    num_tokens, num_experts = biased.shape
    grouped = biased.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)
    ids = masked.topk(top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def select_experts_softmax_grouped(
    router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: router_logits [T, E] float32 -> (weights [T, k], ids [T, k]).

    Softmax scores; with `num_groups` > 1 ("group_limited_greedy") only experts of the
    `topk_groups` groups with the highest best score compete; weights are the scores (no
    renormalisation) times `scaling`.
    """
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [T, E]
    if num_groups > 1:
        num_tokens, num_experts = scores.shape
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        groups = grouped.amax(dim=-1).topk(topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, groups, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(num_tokens, -1)
    weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    return weights * scaling, ids


def _grouped_mm_ready(t: torch.Tensor) -> bool:
    # torch._grouped_mm's rule: one of the two inner dims contiguous, the other's stride a
    # multiple of 16 bytes, a 16-byte aligned start. Layout only, never values: the same
    # answer on every call with the same shapes, so a captured graph replays the same path.
    align = _MM_ALIGN_BYTES // t.element_size()
    rows, cols = t.stride(-2), t.stride(-1)
    lead = rows if cols == 1 else cols if rows == 1 else 0
    return lead > 0 and lead % align == 0 and t.data_ptr() % _MM_ALIGN_BYTES == 0


def _grouped_linear(
    a: torch.Tensor,
    w: torch.Tensor,
    expert_of_row: torch.Tensor,
    ends: torch.Tensor,
    invariant: bool = False,
) -> torch.Tensor:
    """a [S, in] with rows grouped by expert; w [E, out, in] -> a @ w[expert].T, [S, out].

    `expert_of_row` [S] and `ends` [E] int32 (exclusive end row of each expert's group) describe
    the same grouping; an expert with no rows is an empty group. `invariant`: one reduction
    order per row whatever the group sizes (the batch-invariant mode).
    """
    if invariant:
        return grouped_linear(a, w, ends)
    wt = w.transpose(1, 2)  # [E, in, out], column-major: leading stride `in`
    if _grouped_mm_ready(a) and _grouped_mm_ready(wt):
        # NOTE: on CUDA this is the device-only CUTLASS kernel for bfloat16 on sm90 / sm100;
        # other dtypes and GPUs get ATen's per-group fallback, which copies `ends` to the host.
        return torch._grouped_mm(a, wt, offs=ends)
    # Strides off the 16-byte rule (tiny models with odd sizes): every row with its own
    # expert's weight. HAZARD: gathers S weight matrices, [S, out, in]; fine for the small
    # shapes that land here, too big for a real model's prefill.
    return torch.bmm(w.index_select(0, expert_of_row), a.unsqueeze(2)).squeeze(2)


def expert_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    hidden_act: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Weighted sum of each token's experts.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    weights / ids [T, k] -> [T, H]. Optional per-expert biases b13 [E, 2I], b2 [E, H], and
    `act` ([S, 2I] -> [S, I]) in place of `act_and_mul(., hidden_act)` (gpt-oss).
    `invariant`: the batch-invariant mode's row-invariant expert matmuls.
    """
    num_tokens = ids.shape[0]
    # S = k * T entries, slot-major (entry j * T + t is token t's slot j), stably sorted by
    # expert: inside an expert's group the rows come slot by slot, token by token, as in HF
    sorted_ids, order = torch.sort(ids.t().reshape(-1), stable=True)  # [S]
    experts = torch.arange(w13.shape[0], device=ids.device)
    # [E] = cumsum(bincount(ids)); bincount on CUDA reads max(ids) on the host, this does not
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    rows = x.index_select(0, order % num_tokens)
    h = _grouped_linear(rows, w13, sorted_ids, ends, invariant)  # [S, 2I]
    h = _activated(h, b13, sorted_ids, act, hidden_act, invariant)  # [S, I]
    h = _grouped_linear(h, w2, sorted_ids, ends, invariant)  # [S, H]
    if b2 is not None:
        h = h + b2.index_select(0, sorted_ids)
    # float32 weights (DeepSeek's router in the batch-invariant mode, as HF keeps them): the
    # product in float32, rounded once to x's dtype as HF's experts loop does; weights in x's
    # dtype (every other caller) make the cast a no-op
    h = (h * weights.t().reshape(-1).index_select(0, order).unsqueeze(1)).to(x.dtype)
    return _sum_in_expert_order(h, ids, order)


def _activated(
    h: torch.Tensor,
    b13: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] | None,
    hidden_act: str,
    invariant: bool,
) -> torch.Tensor:
    """h [S, 2I] (gate rows then up rows, row r on expert sorted_ids[r]) -> [S, I]: the
    expert's gate/up bias, then `act`, or else act(gate) * up."""
    if b13 is not None:
        h = h + b13.index_select(0, sorted_ids)
    if act is not None:
        return act(h)
    return silu_and_mul(h, hidden_act) if invariant else act_and_mul(h, hidden_act)


def _sum_in_expert_order(h: torch.Tensor, ids: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """h [S, H], row r for slot-major entry order[r] -> [T, H]: each token's k rows added onto
    zero in ascending expert order, the order and roundings of HF's per-expert index_add_.
    Deterministic on every device (no atomics), unlike one index_add_ with repeated tokens."""
    num_tokens, top_k = ids.shape
    tokens = torch.arange(num_tokens, device=ids.device).unsqueeze(1)
    entry = ids.argsort(dim=1) * num_tokens + tokens  # [T, k]: token t's r-th smallest expert
    row_of_entry = torch.argsort(order)  # [S], the inverse permutation
    rows = row_of_entry.index_select(0, entry.reshape(-1))  # a gather: faster than a scatter
    per_token = h.index_select(0, rows).view(num_tokens, top_k, h.shape[1])
    out = per_token[:, 0]  # 0 + a == a
    for j in range(1, top_k):  # static k
        out = out + per_token[:, j]
    return out


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    hidden_act: str = "silu",
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route and compute: (out [T, H], chosen expert ids [T, k] int32)."""
    weights, ids = select_experts(router_logits, top_k, renormalize)
    out = expert_forward(x, w13, w2, weights, ids, hidden_act, invariant=invariant)
    return out, ids.to(torch.int32)
