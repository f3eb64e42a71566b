"""Sampling math on a batch of logits rows: penalties, truncation, seeded draws, logprobs.

Every function takes `[batch, vocab]` float tensors and per-row parameter tensors, so one call
serves a whole step; no host syncs inside except where noted.
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """vLLM/OpenAI penalties.

    repetition (CTRL paper): tokens seen in prompt or output have positive logits divided and
    negative logits multiplied by the penalty. presence/frequency: subtract `presence * [count>0]`
    and `frequency * count` over output tokens.
    logits [B, V]; prompt_mask [B, V] bool; output_counts [B, V] float; penalties [B].
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus.

    top_k [B] int64 (vocab size means off); top_p [B] float (1.0 means off). The nucleus keeps
    the most probable tokens until their cumulative probability reaches top_p (always >= 1 token).
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        drop |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below `min_p * max_prob` (min_p [B], 0 means off)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def kept_log_mass(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log of the probability mass of the `kept` tokens [B, V] under softmax(logits) [B, V]:
    what truncation left of the distribution a token is drawn from. Returns [B]."""
    full = logits.log_softmax(dim=-1)
    return full.masked_fill(~kept, float("-inf")).logsumexp(dim=-1)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None],
                default: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row by the exponential race `argmax(p / E)`, `E ~ Exp(1)`.

    A row with its own generator consumes exactly `vocab` draws from it per call, whatever the
    batch, which makes seeded requests batch-independent. Returns [B] int64.
    """
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        idx = torch.tensor(shared, device=probs.device)
        noise[idx] = torch.empty(len(shared), probs.shape[1], device=probs.device,
                                 dtype=probs.dtype).exponential_(generator=default)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    # a zero draw would turn a zero-probability token into nan; clamp keeps it at 0
    return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest logprobs per row and their token ids: ([B, n], [B, n])."""
    values, ids = logprobs.topk(n, dim=-1)
    return values, ids
