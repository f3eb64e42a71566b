"""A request: one prompt, its `n` sequences, and how to report them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from raylane.actors.engine.detokenizer import IncrementalDetokenizer
from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.sequence import Sequence


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        tokenizer,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.error: str | None = None  # a step it was in failed
        self.seqs = [
            Sequence(request_id, i, prompt_token_ids, params, block_size) for i in range(params.n)
        ]
        # samples 2..n start once the first one's prompt is in the cache, so they share its blocks
        self.seqs[0].siblings = self.seqs[1:]
        self.detokenizers = {
            s.seq_id: IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            for s in self.seqs
        }
        self._sent = {s.seq_id: _Sent() for s in self.seqs}  # what delta() handed out
        self._prompt_sent = False
        self._prompt_logprobs_sent = 0
        # text that could still become a stop string (trimmed on a match) stays back until
        # it cannot, so a delta never has to take back text it sent
        self._hold = max((len(s) for s in params.stop_list), default=1) - 1

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def detokenize(self, seq: Sequence) -> str:
        delta = self.detokenizers[seq.seq_id].step(seq.token_ids, seq.num_prompt_tokens)
        seq.text += delta
        return delta

    def delta(self, weight_version: int) -> EngineCoreOutput:
        """What the request gained since the last delta (the first one carries the prompt)."""
        head, first = self.seqs[0], not self._prompt_sent
        self._prompt_sent = True
        samples = [d for s in self.seqs if (d := self._sample_delta(s, first)) is not None]
        return EngineCoreOutput(
            request_id=self.request_id,
            outputs=samples,
            finished=self.finished,
            weight_version=weight_version,
            num_cached_tokens=head.num_cached_tokens,
            prompt=self.prompt if first else None,
            prompt_token_ids=head.token_ids[: head.num_prompt_tokens] if first else None,
            **self._new_prompt_logprobs(head),
            metrics=self._metrics() if self.finished else None,
            error=self.error,
        )

    def _new_prompt_logprobs(self, head: Sequence) -> dict[str, list | None]:
        """The prompt-logprob entries (and the tokens' ranks) computed since the last delta."""
        if self.params.prompt_logprobs is None:
            return {"prompt_logprobs": None, "prompt_ranks": None}
        start, self._prompt_logprobs_sent = self._prompt_logprobs_sent, len(head.prompt_logprobs)
        return {
            "prompt_logprobs": head.prompt_logprobs[start:],
            "prompt_ranks": head.prompt_ranks[start:],
        }

    def _sample_delta(self, seq: Sequence, first: bool) -> SampleDelta | None:
        sent = self._sent[seq.seq_id]
        if sent.done:
            return None
        finished = seq.finish_reason is not None
        n0, c0 = sent.tokens, sent.chars
        end = len(seq.text) if finished else max(c0, len(seq.text) - self._hold)
        if not first and not finished and seq.num_output_tokens == n0 and end == c0:
            return None
        sent.tokens, sent.chars, sent.done = seq.num_output_tokens, end, finished
        asked = self.params.logprobs is not None
        return SampleDelta(
            index=seq.index,
            text=seq.text[c0:end],
            token_ids=seq.token_ids[seq.num_prompt_tokens + n0 :],
            logprobs=seq.logprobs[n0:] if asked else None,
            top_logprobs=seq.top_logprobs[n0:] if asked else None,
            weight_versions=seq.weight_versions[n0:],
            kept_mass_logprobs=seq.kept_mass[n0:] if self.params.return_kept_mass else None,
            lora_versions=_lora_versions(seq, seq.num_output_tokens - n0),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            routed_experts=seq.routed_experts if finished else None,
            indexer_topk=seq.indexer_topk if finished else None,
            constrained=self.params.structured_outputs is not None,
            held_text=seq.text[end:],
        )

    def output(self, weight_version: int) -> RequestOutput:
        """The cumulative output so far (a copy; for callers that ask for one, e.g. an abort's
        partial output)."""
        head = self.seqs[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=head.token_ids[: head.num_prompt_tokens],
            outputs=[self._completion(s) for s in self.seqs],
            finished=self.finished,
            num_cached_tokens=head.num_cached_tokens,
            weight_version=weight_version,
            prompt_logprobs=list(head.prompt_logprobs)
            if self.params.prompt_logprobs is not None
            else None,
            prompt_ranks=list(head.prompt_ranks)
            if self.params.prompt_logprobs is not None
            else None,
            metrics=self._metrics(),
            error=self.error,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        asked = self.params.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(seq.logprobs) if asked else None,
            top_logprobs=list(seq.top_logprobs) if asked else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            routed_experts=seq.routed_experts,
            indexer_topk=seq.indexer_topk,
            weight_versions=list(seq.weight_versions),
            kept_mass_logprobs=list(seq.kept_mass) if self.params.return_kept_mass else None,
            lora_versions=_lora_versions(seq, seq.num_output_tokens),
            constrained=self.params.structured_outputs is not None,
        )

    def _metrics(self) -> dict[str, float]:
        m = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            m["time_to_first_token"] = self.first_token_time - self.arrival_time
        return m


def _lora_versions(seq: Sequence, count: int) -> list[int] | None:
    """A sequence keeps its adapter version to its end: each of `count` tokens has it."""
    return None if seq.lora is None else [seq.lora.version] * count


@dataclass
class _Sent:
    tokens: int = 0
    chars: int = 0
    done: bool = False
