"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

from raylane.actors.engine.sequence import Sequence


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text without re-decoding everything each step.

    Decodes a short window (`prefix_offset` .. end) and emits what it adds beyond the already
    emitted part; an incomplete UTF-8 sequence (U+FFFD at the end) waits for the next token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, ids: list[int], start: int = 0) -> str:
        """The text `ids[start:]` (the output so far) adds since the last call. `start` lets a
        caller pass a sequence's whole token list without copying its output part out."""
        prefix = self._decode(ids[start + self.prefix_offset : start + self.read_offset])
        full = self._decode(ids[start + self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids) - start
            return full[len(prefix) :]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""


class StopChecker:
    """Decides after each new token whether a sequence is done, and trims a matched stop string."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, delta: str) -> None:
        params, token = seq.params, seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
            if token in (params.stop_token_ids or ()):
                return self._finish(seq, "stop", token)
            if delta and params.stop_list and self._match_stop(seq, len(delta)):
                return None
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self._finish(seq, "length", None)
        if len(seq.token_ids) >= self.max_model_len:  # known tokens: pending ones may follow
            return self._finish(seq, "length", None)
        return None

    def _match_stop(self, seq: Sequence, delta_len: int) -> bool:
        params = seq.params
        longest = max(len(s) for s in params.stop_list)
        window_start = max(0, len(seq.text) - delta_len - longest + 1)
        # the earliest match in the text wins, so the kept text never holds any stop string
        found = [
            (at, stop)
            for stop in params.stop_list
            if (at := seq.text.find(stop, window_start)) >= 0
        ]
        if not found:
            return False
        at, stop = min(found)
        seq.text = seq.text[: at + len(stop) if params.include_stop_str_in_output else at]
        self._finish(seq, "stop", stop)
        return True

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
