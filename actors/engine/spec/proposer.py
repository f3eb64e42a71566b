"""Proposer: the drafts a step can take without a distribution, by the configured method:
prompt lookup ("ngram"), the suffix index over a request and its siblings ("suffix"), or the
tokens the runner's MTP layers drafted after a sequence's newest token ("mtp"); a draft model's
are drawn on the runner instead. The Drafter (spec/drafter.py) decides which rows draft and how
many; this only answers what they would be.
"""

from __future__ import annotations

from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.spec.config import SpeculativeConfig
from raylane.actors.engine.spec.ngram import NgramProposer
from raylane.actors.engine.spec.suffix import SuffixIndex


class Proposer:
    def __init__(self, config: SpeculativeConfig):
        self.method = config.method
        self.ngram = (
            NgramProposer(config.prompt_lookup_min or 1, config.prompt_lookup_max or 1)
            if config.method == "ngram"
            else None
        )
        self.suffix = (
            SuffixIndex(min_probability=config.suffix_min_probability)
            if config.method == "suffix"
            else None
        )
        # mtp: seq_id -> (its token count when the runner drafted, the drafts after them)
        self._mtp: dict[int, tuple[int, tuple[int, ...]]] = {}

    def lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to k drafts and the length of the match they follow ([] and 0: none)."""
        if self.ngram is not None:
            return self.ngram.propose_matched(seq.token_ids, k)
        if self.method == "mtp":
            num_tokens, tokens = self._mtp.get(seq.seq_id, (-1, ()))
            return (list(tokens[:k]) if num_tokens == len(seq.token_ids) else []), 1
        if self.suffix is None:
            return [], 0
        if seq.seq_id not in self.suffix:
            self.suffix.add(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        return self.suffix.propose_matched(seq.seq_id, k)

    def keep_mtp(self, seq: Sequence, tokens: tuple[int, ...]) -> None:
        """The MTP layers drafted `tokens` after the sequence's newest token: its next lookup
        gets them while it holds exactly these tokens."""
        self._mtp[seq.seq_id] = (len(seq.token_ids), tokens)

    def forget(self, seq_id: int) -> None:
        self._mtp.pop(seq_id, None)
        if self.suffix is not None:
            self.suffix.remove(seq_id)
