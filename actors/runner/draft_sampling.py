"""Drawing drafts from a drafter's distribution q (a draft model, MTP layers), and which rule
verifies them (spec_verify.py).

- Greedy requests: the draft is q's argmax and is kept while it equals the target's argmax.
- Unseeded sampled requests: the draft is drawn from q with random words of a stream of its
  own (the position's words with DRAFT_STREAM set in the position counter, so independent of
  the target's words), and the runner verifies it by speculative sampling: kept with
  probability min(1, p/q), else the residual's draw (`kernels.sampling.speculative_accept`).
  q travels with the draft.
- Seeded sampled requests: the draft is drawn from q with the position's own words, the ones
  the target draws that position's token with, and is kept while it equals that token. The
  token is then the one decoding without drafts gives, whatever was drafted, so a seeded
  request is reproducible and batch-independent even though how many positions are drafted
  depends on the batch (budget, cost model, async steps); under min(1, p/q) a drafted
  position's token would depend on q. The shared words make d and the target's token agree
  often (P >= (1 - TV) / (1 + TV) for the exponential race; min(1, p/q) reaches 1 - TV).
"""

from __future__ import annotations

import torch
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.sampler import distribution, position_words
from raylane.kernels import sampling

DRAFT_STREAM = 1 << 31  # set in the position counter of a draft's own words


def verified_by_ratio(params: SamplingParams) -> bool:
    """Its drafts carry q and are verified by min(1, p/q) (see the module docstring)."""
    return not params.greedy and params.seed is None


def draft_words(
    params: SamplingParams, sample_index: int, seq_id: int, engine_seed: int, position: int
) -> tuple[int, int, int]:
    """The words a draft at output `position` is drawn with."""
    key, ctr0, ctr1 = position_words(params.seed, sample_index, seq_id, engine_seed, position)
    return (key, ctr0, ctr1 ^ DRAFT_STREAM) if verified_by_ratio(params) else (key, ctr0, ctr1)


def draw_drafts(
    logits: torch.Tensor,
    params: list[SamplingParams],
    words: list[tuple[int, int, int]],
    vocab_size: int,
) -> tuple[list[int], torch.Tensor]:
    """One draft per row of the drafter's logits [R, V]: (tokens, q [R, V] float32), q being
    the request's sampling distribution (temperature, top-k, top-p, min-p) over the drafter's
    logits; a greedy row's token is its argmax."""
    logits = logits[:, :vocab_size].float()
    _, probs = distribution(logits, params, vocab_size)
    w = torch.tensor(words, dtype=torch.long, device=logits.device)  # [R, 3]
    drawn = sampling.sample_race(probs, w[:, 0], w[:, 1], w[:, 2])
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    return tokens.tolist(), probs / probs.sum(dim=-1, keepdim=True)
