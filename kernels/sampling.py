"""Sampling math on a batch of logits rows: penalties, truncation, seeded draws, logprobs.

Every function takes `[batch, vocab]` float tensors and per-row parameter tensors, so one call
serves a whole step; no host syncs inside except where noted.
"""

from __future__ import annotations

import torch
from raylane.kernels.batch_invariant.row_reductions import RowReductions


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
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


def kept_log_mass(
    logits: torch.Tensor, kept: torch.Tensor, rows: RowReductions | None = None
) -> torch.Tensor:
    """log of the probability mass of the `kept` tokens [B, V] under softmax(logits) [B, V]:
    what truncation left of the distribution a token is drawn from. Returns [B]. `rows`: the
    log_softmax and logsumexp to take (the batch-invariant mode's on CUDA), else torch's."""
    rows = rows or RowReductions()
    full = rows.log_softmax(logits)
    return rows.logsumexp(full.masked_fill(~kept, float("-inf")))


# Philox2x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
PHILOX_M = 0xD256D193  # round multiplier
PHILOX_W = 0x9E3779B9  # key increment per round (golden ratio)
PHILOX_ROUNDS = 10
MASK32 = 0xFFFF_FFFF


def _mulhilo32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of `PHILOX_M * x` for int64 x in [0, 2^32), exactly.

    The product reaches 2^64, past int64, so the multiplier goes in 16-bit halves and no
    intermediate reaches 2^49.
    """
    low_part = x * (PHILOX_M & 0xFFFF)  # < 2^48
    high_part = x * (PHILOX_M >> 16)  # < 2^48; stands for high_part * 2^16
    # product = (high_part >> 16) * 2^32 + partial
    partial = low_part + ((high_part & 0xFFFF) << 16)  # < 2^49
    return (high_part >> 16) + (partial >> 32), partial & MASK32


def philox2x32(
    key: torch.Tensor, ctr0: torch.Tensor, ctr1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox2x32-10 of one 2x32-bit counter under one 32-bit key per row.

    All three are int64 holding unsigned 32-bit values, of one shape or broadcastable ([B], or
    [B, 1] against [1, N]); returns the two output words in the broadcast shape.
    Plain tensor ops (no host sync, no generator), so it runs on any device and in a CUDA graph.
    """
    for _ in range(PHILOX_ROUNDS):
        hi, lo = _mulhilo32(ctr0)
        ctr0, ctr1 = hi ^ key ^ ctr1, lo
        key = (key + PHILOX_W) & MASK32
    return ctr0, ctr1


def philox_uniform(key: torch.Tensor, ctr0: torch.Tensor, ctr1: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, [B] float64 with 53 random bits: a pure function of the
    row's (key, counter), whatever the batch or device."""
    word0, word1 = philox2x32(key, ctr0, ctr1)
    bits = ((word0 >> 5) << 26) | (word1 >> 6)  # 27 + 26 bits, < 2^53: exact in float64
    return bits.double() * 2.0**-53


RACE_BLOCK = 256  # tokens per block of the two-level race


def sample_race(
    probs: torch.Tensor, key: torch.Tensor, ctr0: torch.Tensor, ctr1: torch.Tensor
) -> torch.Tensor:
    """Draw one token per row by the exponential race `argmax(p_i / E_i)`, `E_i ~ Exp(1)`,
    with every E_i a pure function of the row's Philox (key, counter): [B] int64.

    Two levels, so only a few hundred draws per row are made instead of one per token: a
    race among blocks of RACE_BLOCK tokens, weighted by their mass, then a race inside the
    winning block. P(block) * P(token | block) = (m_b / M) * (p_i / m_b) = p_i / M, exactly.
    Unlike an inverse-CDF draw (one uniform against a running sum over the vocabulary), the
    winner only changes when two scores are all but tied, so a logit that differs in the last
    bits (another batch, another TP split) almost never changes a seeded request's token.
    probs [B, V] (rows need not sum to 1); key, ctr0, ctr1 [B] unsigned 32-bit words.
    """
    batch, vocab = probs.shape
    num_blocks = -(-vocab // RACE_BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, num_blocks * RACE_BLOCK - vocab))
    blocks = blocks.view(batch, num_blocks, RACE_BLOCK)
    # the row's own key for this draw: (stream, position) -> 64 bits, then one counter per E_i
    row_key, row_ctr = philox2x32(key, ctr0, ctr1)
    mass = blocks.sum(dim=-1, dtype=torch.float64)  # [B, num_blocks]
    block = (mass / _exponentials(row_key, row_ctr, 0, num_blocks)).argmax(dim=-1)
    inside = blocks[torch.arange(batch, device=probs.device), block].double()  # [B, BLOCK]
    pick = (inside / _exponentials(row_key, row_ctr, 1 << 31, RACE_BLOCK)).argmax(dim=-1)
    return block * RACE_BLOCK + pick


ACCEPT_COUNTER = 1 << 30  # the acceptance uniform's counter (the race uses [0, blocks), 2^31 +)


def speculative_accept(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    key: torch.Tensor,
    ctr0: torch.Tensor,
    ctr1: torch.Tensor,
) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of one position per row:
    the draft d, drawn from q, is kept with probability min(1, p(d) / q(d)); otherwise the token
    is drawn from the residual max(0, p - q), renormalised. The result is distributed as p.

    p [R, V] the target's probabilities (rows need not sum to 1); q [R, V] the distribution d
    was drawn from (with randomness independent of the row's words); draft [R] int64; key,
    ctr0, ctr1 [R] the position's words: the acceptance uniform is Philox at ACCEPT_COUNTER
    under the row's draw key, the residual draw is `sample_race` of those words (counters
    apart, so the two are independent). Returns [R] int64.
    """
    p = p / p.sum(dim=-1, keepdim=True)
    row_key, row_ctr = philox2x32(key, ctr0, ctr1)
    u = philox_uniform(row_key, row_ctr, torch.full_like(row_key, ACCEPT_COUNTER))
    p_d = p.gather(1, draft.unsqueeze(1)).squeeze(1).double()
    q_d = q.gather(1, draft.unsqueeze(1)).squeeze(1).double()
    keep = u * q_d < p_d  # u < p(d) / q(d), without dividing by a q(d) of 0
    residual = (p - q).clamp_(min=0)
    # p == q up to rounding leaves no residual mass: any rejection then is rounding; draw p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return torch.where(keep, draft, sample_race(residual, key, ctr0, ctr1))


def _exponentials(key: torch.Tensor, ctr: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Exp(1) draws [B, count] float64 at counters (ctr, first + j) under each row's key."""
    index = torch.arange(first, first + count, device=key.device).unsqueeze(0)  # [1, count]
    u = philox_uniform(key.unsqueeze(1), ctr.unsqueeze(1), index)  # [B, count] in [0, 1)
    # -log(1 - u) > 0; a zero (u = 0, odds 2^-53) would make 0 / 0 for a zero-mass entry
    return torch.log1p(-u).neg_().clamp_(min=1e-300)


def unpack_token_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """A grammar's int32 bit sets [R, W] (bit t of word t // 32 allows token t) as bool [R,
    vocab]. Plain tensor ops: no host sync, any device."""
    bits = torch.ones(32, dtype=torch.int64, device=words.device) << torch.arange(
        32, device=words.device
    )
    bits = bits.to(torch.int32)  # bit 31 wraps to the sign bit, as in the words
    return ((words.unsqueeze(-1) & bits) != 0).view(words.shape[0], -1)[:, :vocab]


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest logprobs per row and their token ids: ([B, n], [B, n])."""
    values, ids = logprobs.topk(n, dim=-1)
    return values, ids
