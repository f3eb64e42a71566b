"""A request: one prompt, its `n` sequences, and how to report them."""

from __future__ import annotations

import time

from raylane.actors.engine.detokenizer import IncrementalDetokenizer
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
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

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def detokenize(self, seq: Sequence) -> str:
        delta = self.detokenizers[seq.seq_id].step(seq.output_token_ids)
        seq.text += delta
        return delta

    def output(self, weight_version: int) -> RequestOutput:
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
            weight_versions=list(seq.weight_versions),
            kept_mass_logprobs=list(seq.kept_mass) if self.params.return_kept_mass else None,
            constrained=self.params.structured_outputs is not None,
        )

    def _metrics(self) -> dict[str, float]:
        m = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            m["time_to_first_token"] = self.first_token_time - self.arrival_time
        return m
