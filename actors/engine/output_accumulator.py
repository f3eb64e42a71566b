"""Cumulative outputs, built from the engine's deltas only where a caller asks for them.

The engine hands out `EngineCoreOutput`s: what each request gained in a step. The offline
`LLMEngine.generate`, `AsyncLLMEngine.generate` and a non-streaming HTTP response want the
cumulative `RequestOutput` (every token so far); an `OutputAccumulator` per request folds the
deltas in. Streaming paths (the replica's output channel, SSE) never build one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
    copy_list,
)

_LISTS = (
    "token_ids",
    "logprobs",
    "top_logprobs",
    "weight_versions",
    "kept_mass_logprobs",
    "lora_versions",
)


class OutputAccumulator:
    """Folds one request's deltas into its cumulative output. `add` extends the accumulated
    lists in place; `output()` returns a snapshot that later deltas leave as it was."""

    def __init__(self) -> None:
        self._samples: dict[int, CompletionOutput] = {}
        self._head: EngineCoreOutput | None = None
        self._prompt: str | None = None
        self._prompt_ids: list[int] = []
        self._prompt_logprobs: list | None = None
        self._prompt_ranks: list | None = None
        self._metrics: dict[str, float] = {}
        # the highest seen: a caller's own last delta (a deadline's) does not know them
        self._weight_version = 0
        self._cached = 0

    def add(self, delta: EngineCoreOutput) -> None:
        self._head = delta
        if delta.prompt_token_ids is not None:
            self._prompt_ids = delta.prompt_token_ids
            self._prompt = delta.prompt
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = (self._prompt_logprobs or []) + delta.prompt_logprobs
            self._prompt_ranks = (self._prompt_ranks or []) + (delta.prompt_ranks or [])
        if delta.metrics:
            self._metrics = delta.metrics
        self._weight_version = max(self._weight_version, delta.weight_version)
        self._cached = max(self._cached, delta.num_cached_tokens)
        for d in delta.outputs:
            self._fold(d)

    def _fold(self, d: SampleDelta) -> None:
        c = self._samples.get(d.index)
        if c is None:
            self._samples[d.index] = d.completion()
            return
        c.text += d.text
        for name in _LISTS:
            new, have = getattr(d, name), getattr(c, name)
            if new is not None and have is not None:
                have.extend(new)
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        if d.routed_experts is not None:
            c.routed_experts = d.routed_experts
        if d.indexer_topk is not None:
            c.indexer_topk = d.indexer_topk

    def output(self) -> RequestOutput:
        """The cumulative output after the deltas added so far (fresh lists)."""
        out = self.live()
        out.outputs = [_snapshot(c) for c in out.outputs]
        out.prompt_logprobs = copy_list(out.prompt_logprobs)
        out.prompt_ranks = copy_list(out.prompt_ranks)
        return out

    def live(self) -> RequestOutput:
        """The cumulative output without copying: its samples' lists are the accumulator's
        own, which the next `add` extends (for a caller that reads it at once)."""
        head = self._head
        if head is None:
            raise ValueError("no output was added to the accumulator yet")
        return RequestOutput(
            request_id=head.request_id,
            prompt=self._prompt,
            prompt_token_ids=self._prompt_ids,
            outputs=[self._samples[i] for i in sorted(self._samples)],
            finished=head.finished,
            num_cached_tokens=self._cached,
            weight_version=self._weight_version,
            prompt_logprobs=self._prompt_logprobs,
            prompt_ranks=self._prompt_ranks,
            metrics=dict(self._metrics),
            error=head.error,
        )


async def cumulative(
    deltas: AsyncIterator[EngineCoreOutput],
) -> AsyncGenerator[RequestOutput, None]:
    """One request's deltas as cumulative outputs; closing this closes `deltas`."""
    acc = OutputAccumulator()
    try:
        async for delta in deltas:
            acc.add(delta)
            yield acc.output()
    finally:
        aclose = getattr(deltas, "aclose", None)
        if aclose is not None:
            await aclose()


def accumulate(deltas: list[EngineCoreOutput]) -> RequestOutput:
    """The cumulative output of one request's deltas, in order."""
    acc = OutputAccumulator()
    for d in deltas:
        acc.add(d)
    return acc.output()


def run_to_completion(
    ids: list[str], step: Callable[[], list[EngineCoreOutput]], use_tqdm: bool = True
) -> list[RequestOutput]:
    """Call `step` until every request in `ids` (already added) has finished; their
    cumulative outputs, in the order of `ids` (`LLMEngine.generate`)."""
    accumulators = {rid: OutputAccumulator() for rid in ids}
    finished: dict[str, RequestOutput] = {}
    with _progress(len(ids), use_tqdm) as bar:
        while len(finished) < len(ids):
            for delta in step():
                accumulators[delta.request_id].add(delta)
                if delta.finished:
                    finished[delta.request_id] = accumulators[delta.request_id].output()
                    bar.update(1)
    return [finished[rid] for rid in ids]


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req", disable=not enabled)


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    copy = dataclasses.replace(c)
    for name in _LISTS:
        setattr(copy, name, copy_list(getattr(c, name)))
    return copy
