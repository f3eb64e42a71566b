"""DraftModelProposer: a small model with the target's vocabulary proposes k tokens greedily.

Design (the simplest correct one; docs/speculative_decoding.md): the draft model runs in the
engine process, on CPU, as a transformers causal LM with one KV cache per sequence (the
library's `DynamicCache`; the target's paged blocks are not shared). Each cache holds the KV
of a prefix of the sequence's tokens, including drafts it proposed last time. Rolling back
the rejected drafts is cropping the cache to the longest prefix it shares with the sequence's
tokens now (accepted drafts are that prefix; the target's own token after them is not), so a
preempted or retracted sequence, or one updated mid-way, needs nothing special.

Greedy requests get argmax drafts. Sampled requests get drafts drawn from q, the draft's
distribution under the request's temperature, top-k, top-p and min-p (`DraftDraw`; penalties
and grammars are the target's alone: q need not equal p for exactness, only the acceptance
rate falls); runner/draft_sampling.py says which rule verifies them.
"""

from __future__ import annotations

import numpy as np
import torch
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.draft_sampling import draft_words, draw_drafts, verified_by_ratio

_OWNER = "EngineConfig.speculative_config"


class DraftModelProposer:
    def __init__(self, path: str, target_vocab_size: int, target_tokenizer=None):
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{_OWNER}.model: cannot load a model config from {path!r}: {e}")
        draft_vocab = getattr(config.get_text_config(), "vocab_size", None)
        if draft_vocab != target_vocab_size:
            raise ValueError(
                f"{_OWNER}.model: the draft's vocab_size ({draft_vocab}) differs from the "
                f"target's ({target_vocab_size}); a draft model needs the target's tokenizer"
            )
        _check_tokenizer(path, target_tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # seq_id -> (its cache, the tokens whose KV the cache holds)
        self._caches: dict[int, tuple[object, list[int]]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._caches

    @torch.inference_mode()
    def propose(
        self, seq_id: int, token_ids: list[int], k: int, draw: DraftDraw | None = None
    ) -> tuple[list[int], np.ndarray | None]:
        """k tokens after `token_ids`, and the distributions q [k, V] they were drawn from when
        they are verified by min(1, p/q); greedy (argmax, q None) without `draw`. The cache
        is left holding all but the last."""
        cache, cached = self._cached(seq_id, token_ids)
        fresh = token_ids[len(cached) :]
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        for j in range(k):
            ids = torch.tensor([fresh])
            logits = self.model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1:]
            cached = cached + fresh
            if draw is None:
                drafts.append(int(logits[0].argmax()))
            else:
                token, q = draw(logits, j)
                drafts.append(token)
                if q is not None:
                    qs.append(q)
            fresh = drafts[-1:]
        self._caches[seq_id] = (cache, cached)
        return drafts, (np.stack(qs) if qs else None)

    def _cached(self, seq_id: int, token_ids: list[int]) -> tuple[object, list[int]]:
        """The sequence's cache cropped to the prefix it shares with `token_ids` (at most all
        but the last token, which is fed to get the first draft's logits)."""
        from transformers import DynamicCache

        entry = self._caches.get(seq_id)
        if entry is None:
            return DynamicCache(config=self.model.config), []
        cache, cached = entry
        keep = 0
        limit = min(len(cached), len(token_ids) - 1)
        while keep < limit and cached[keep] == token_ids[keep]:
            keep += 1
        if keep == 0:
            return DynamicCache(config=self.model.config), []
        if keep < len(cached):
            cache.crop(keep - len(cached))  # type: ignore[attr-defined]  # (negative: drop)
        return cache, cached[:keep]

    def remove(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)


def _check_tokenizer(path: str, target_tokenizer) -> None:
    """Where both sides have a tokenizer, the same token must have the same id."""
    if target_tokenizer is None:
        return
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return  # weights only: the vocab size check is all there is
    if draft.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"{_OWNER}.model: the draft's tokenizer vocabulary differs from the target's"
        )


class DraftDraw:
    """Draws a sequence's drafts from the draft's logits: draft j at output position
    `position + j`, with its words (draft_sampling.draft_words)."""

    def __init__(
        self,
        params: SamplingParams,
        sample_index: int,
        seq_id: int,
        engine_seed: int,
        position: int,
        vocab_size: int,
    ):
        self.params, self.position, self.vocab_size = params, position, vocab_size
        self._key = (sample_index, seq_id, engine_seed)

    def __call__(self, logits: torch.Tensor, j: int) -> tuple[int, np.ndarray | None]:
        """logits [1, V] -> (the draft, q [V] float32 when min(1, p/q) verifies it)."""
        words = draft_words(self.params, *self._key, self.position + j)
        tokens, probs = draw_drafts(logits, [self.params], [words], self.vocab_size)
        return tokens[0], probs[0].numpy() if verified_by_ratio(self.params) else None
