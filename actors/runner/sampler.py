"""The runner's sampler: per-row parameters in, one token per row out, with raw logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.requests import RequestState
from raylane.kernels import sampling
from raylane.kernels.batch_invariant.row_reductions import row_reductions


@dataclass(frozen=True)
class Proposal:
    """A draft token and the distribution q [V] it was drawn from (a tensor, or a float32
    array from the plan)."""

    token: int
    probs: object


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # raw logprob of each sampled token (when asked)
    top_logprobs: list[dict[int, float] | None]
    kept_mass: list[float | None]  # log of the mass truncation kept, when asked


class Sampler:
    """Samples the rows of one step. Each row's random numbers are a pure function of (seed,
    stream, output position): a seeded request's stream is its sample index, an unseeded one's
    is its seq_id under the engine seed. So a seeded request's tokens do not depend on its batch,
    row order, async scheduling, TP size or preemption."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        seed: int,
        batch_invariant: bool = False,
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.seed = seed  # the engine's, for unseeded requests
        # log_softmax and logsumexp: on CUDA in the batch-invariant mode, the Triton kernels
        # of one order per row, which a trainer's `raylane.batch_invariant()` runs too
        self.rows = row_reductions(batch_invariant, device)

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        tokens_only: bool = False,
        masks: list | None = None,
        proposals: list[Proposal | None] | None = None,
    ) -> SampleResult:
        """Sample a token per row; `tokens_only` skips logprobs and kept mass (a rank that
        only needs to know what was sampled). `masks`: per row, None or a grammar's int32 bit
        set of the allowed tokens, applied after the raw logprobs are taken. `proposals`: per
        row, None or a draft drawn from a distribution q, which the row's token replaces by
        speculative sampling (kept with probability min(1, p/q), else the residual's draw)."""
        logits = logits[:, : self.vocab_size].float()  # [B, V]
        wants_logprobs = any(s.params.logprobs is not None for s in states) and not tokens_only
        raw = self.rows.log_softmax(logits) if wants_logprobs else None
        if masks is not None and any(m is not None for m in masks):
            logits = self._apply_grammar(logits, masks)
        logits = self._mask_stop_tokens(logits, states)
        if any(s.params.uses_penalties for s in states):
            logits = self._penalise(logits, states)
        tokens, kept = self._draw(logits, states, tokens_only, proposals)
        kept_mass: list[float | None] = [None] * len(states)
        if kept is not None:
            kept_mass = [
                m if s.params.return_kept_mass else None for m, s in zip(kept.tolist(), states)
            ]
        return SampleResult(tokens.tolist(), *self._logprobs(raw, tokens, states), kept_mass)

    def _draw(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        tokens_only: bool = False,
        proposals: list[Proposal | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids, and the log kept mass of each row when any row asks for it."""
        greedy = logits.argmax(dim=-1)
        wants_kept = any(s.params.return_kept_mass for s in states) and not tokens_only
        if all(s.params.greedy for s in states):
            return greedy, self._greedy_kept(logits, greedy) if wants_kept else None
        params = [s.params for s in states]
        logits, probs = distribution(logits, params, self.vocab_size)
        words = self._column([row_words(s, self.seed) for s in states], torch.long)  # [B, 3]
        sampled = sampling.sample_race(probs, words[:, 0], words[:, 1], words[:, 2])
        if proposals is not None and any(p is not None for p in proposals):
            sampled = _verify(probs, sampled, proposals, words)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(is_greedy, greedy, sampled)
        if not wants_kept:
            return tokens, None
        # greedy rows were not scaled (temperature 1), so `logits` serves both kinds
        kept = torch.where(
            is_greedy,
            self._greedy_kept(logits, greedy),
            sampling.kept_log_mass(logits, probs > 0, self.rows),
        )
        return tokens, kept

    def _apply_grammar(self, logits: torch.Tensor, masks: list) -> torch.Tensor:
        """Tokens a row's grammar does not allow get -inf, in place, for the whole batch in
        one pass (a row without a mask gets an all-ones bit set)."""
        words = np.full((len(masks), -(-logits.shape[1] // 32)), -1, dtype=np.int32)
        for i, mask in enumerate(masks):
            if mask is not None:
                words[i] = mask
        allowed = sampling.unpack_token_bitmask(
            torch.from_numpy(words).to(self.device), logits.shape[1]
        )
        return logits.masked_fill_(~allowed, float("-inf"))

    def _mask_stop_tokens(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop_token_ids cannot be sampled."""
        for i, s in enumerate(states):
            if s.num_output_tokens < s.params.min_tokens:
                stops = list(s.params.stop_token_ids or [])
                if not s.params.ignore_eos:
                    stops += self.eos_token_ids
                if stops:
                    logits[i, torch.tensor(stops, device=logits.device)] = float("-inf")
        return logits

    def _penalise(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        batch, vocab = logits.shape
        prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=logits.device)
        counts = torch.zeros(batch, vocab, device=logits.device)
        for i, s in enumerate(states):
            prompt = torch.tensor(s.token_ids[: s.num_prompt_tokens], device=logits.device)
            prompt_mask[i, prompt] = True
            out = torch.tensor(s.output_token_ids, dtype=torch.long, device=logits.device)
            counts[i].index_add_(0, out, torch.ones(len(out), device=logits.device))
        params = [s.params for s in states]
        return sampling.apply_penalties(
            logits,
            prompt_mask,
            counts,
            self._column([p.repetition_penalty for p in params]),
            self._column([p.presence_penalty for p in params]),
            self._column([p.frequency_penalty for p in params]),
        )

    def _logprobs(
        self, raw: torch.Tensor | None, tokens: torch.Tensor, states: list[RequestState]
    ) -> tuple[list[float | None], list[dict[int, float] | None]]:
        if raw is None:
            return [None] * len(states), [None] * len(states)
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        n_max = max(s.params.logprobs or 0 for s in states)
        top_values, top_ids = sampling.top_logprobs(raw, n_max)
        values, ids = top_values.tolist(), top_ids.tolist()
        top = [
            dict(zip(ids[i][: s.params.logprobs], values[i][: s.params.logprobs]))
            if s.params.logprobs is not None
            else None
            for i, s in enumerate(states)
        ]
        lps = [lp if s.params.logprobs is not None else None for lp, s in zip(chosen, states)]
        return lps, top

    def _greedy_kept(self, logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Greedy is top-k 1 at temperature 1: the kept mass is the argmax's probability."""
        return self.rows.log_softmax(logits).gather(1, greedy.unsqueeze(1)).squeeze(1)

    def _column(self, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


_MASK32, _MASK64 = 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF
# domain tags: a request seeded with the engine seed still gets other numbers than unseeded rows
_SEEDED, _UNSEEDED = 0x5EED_5EED_5EED_5EED, 0x0DE1_A17E_D0DE_1A17


def row_words(state: RequestState, engine_seed: int) -> tuple[int, int, int]:
    """The row's Philox (key, counter0, counter1) at its output position."""
    return position_words(
        state.params.seed, state.sample_index, state.seq_id, engine_seed, state.num_output_tokens
    )


def position_words(
    seed: int | None, sample_index: int, seq_id: int, engine_seed: int, position: int
) -> tuple[int, int, int]:
    """Philox (key, counter0, counter1) of a token draw: (seed, stream) hashed to 64 bits gives
    the key and one counter word, the output position of the token being sampled the other."""
    if seed is not None:
        base = _mix64(_fold64(seed) ^ _SEEDED)
        stream = sample_index  # the n samples of one request differ
    else:
        base = _mix64(_fold64(engine_seed) ^ _UNSEEDED)
        stream = seq_id
    # _mix64 is a bijection: for one seed, distinct streams never share words
    mixed = _mix64(base ^ (stream & _MASK64))
    return mixed & _MASK32, mixed >> 32, position & _MASK32


def _mix64(x: int) -> int:
    """SplitMix64's finaliser (a bijection of 64-bit ints): nearby seeds get unrelated words."""
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def _fold64(seed: int) -> int:
    """Any Python int (SamplingParams does not bound seeds) to 64 bits: an int64 seed is its
    two's complement, a wider one has its higher 64-bit chunks mixed in."""
    folded = seed & _MASK64
    while not -(2**63) <= seed < 2**63:
        seed >>= 64
        folded = _mix64(folded) ^ (seed & _MASK64)
    return folded


def distribution(
    logits: torch.Tensor, params: list[SamplingParams], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits / temperature, probabilities) [B, V] of each row's sampling distribution:
    temperature (greedy rows at 1), top-k, top-p, then min-p (rows may not sum to 1)."""
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logits = logits / temps.to(device).unsqueeze(1)
    top_k = top_p = None
    # a top_k past the vocabulary keeps every token (and may not fit an int64 column)
    if any(p.top_k > 0 for p in params):
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_k = torch.tensor(ks, dtype=torch.long, device=device)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)
    probs = sampling.apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        probs = sampling.apply_min_p(probs, torch.tensor([p.min_p for p in params]).to(device))
    return logits, probs


def _verify(
    probs: torch.Tensor, sampled: torch.Tensor, proposals: list, words: torch.Tensor
) -> torch.Tensor:
    """`sampled` with each proposal's row replaced by speculative sampling of its draft."""
    rows = [i for i, proposal in enumerate(proposals) if proposal is not None]
    index = torch.tensor(rows, device=probs.device)
    q = torch.stack([torch.as_tensor(proposals[i].probs) for i in rows])
    q = q.to(probs.device, torch.float32)
    drafts = torch.tensor([proposals[i].token for i in rows], device=probs.device)
    w = words[index]
    verified = sampling.speculative_accept(probs[index], q, drafts, w[:, 0], w[:, 1], w[:, 2])
    return sampled.index_copy(0, index, verified)
