"""What vLLM's loop gets back: the engine's deltas as `RequestOutput`s of each request's kind.

The engine core hands out `EngineCoreOutput`s (what a request gained in a step; the serving path
streams them on as they are). `LLMEngine.step()`, `abort_request()` and `AsyncLLMEngine.generate`
answer as vLLM's do, in the `SamplingParams.output_kind` each request asked for:
CUMULATIVE (the default) every token so far, DELTA what the step added (the prompt on every
output, prompt logprobs once), FINAL_ONLY one cumulative output when the request ends.
"""

from __future__ import annotations

from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput
from raylane.actors.engine.sampling_params import RequestOutputKind


class OutputShaper:
    """One request's deltas, in order, as the outputs its kind asks for."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        # DELTA keeps only the prompt (it comes on the first delta alone)
        self._acc = None if kind is RequestOutputKind.DELTA else OutputAccumulator()
        self._prompt: str | None = None
        self._prompt_ids: list[int] = []

    def shape(self, delta: EngineCoreOutput) -> RequestOutput | None:
        """The output for this delta; None where the kind has nothing to say (FINAL_ONLY
        before the end)."""
        if self._acc is not None:
            self._acc.add(delta)
            if self.kind is RequestOutputKind.FINAL_ONLY and not delta.finished:
                return None
            return self._acc.output()
        if delta.prompt_token_ids is not None:
            self._prompt, self._prompt_ids = delta.prompt, delta.prompt_token_ids
        return RequestOutput(
            request_id=delta.request_id,
            prompt=self._prompt,
            prompt_token_ids=self._prompt_ids,
            outputs=[d.completion() for d in delta.outputs],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            weight_version=delta.weight_version,
            prompt_logprobs=delta.prompt_logprobs,
            prompt_ranks=delta.prompt_ranks,
            metrics=dict(delta.metrics or {}),
            error=delta.error,
        )


class OutputShapers:
    """The shapers of the requests added through `LLMEngine.add_request`, whose outputs its
    public loop (step, abort_request) reports; each is dropped with its request's final output.
    Requests admitted by the serving path or `generate` have none: their deltas pass by."""

    def __init__(self) -> None:
        self._shapers: dict[str, OutputShaper] = {}

    def start(self, request_id: str, kind: RequestOutputKind) -> None:
        self._shapers[request_id] = OutputShaper(kind)

    def shape(self, deltas: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs = []
        for delta in deltas:
            shaper = self._shapers.get(delta.request_id)
            if shaper is None:
                continue
            out = shaper.shape(delta)
            if delta.finished:
                del self._shapers[delta.request_id]
            if out is not None:
                outputs.append(out)
        return outputs
