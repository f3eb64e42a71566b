"""A model-free `TurnGenerator` for tests and the sessions benchmark.

Replies come from a function of the prompt ids; routed-expert blobs from another, over the whole
prefix like a real MoE engine's; outputs carry `weight_version`. `gate` holds every turn until
set, so tests can observe a turn in flight; `seen` keeps each prompt the generator was asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import numpy as np
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams

ReplyFn = Callable[[list[int]], CompletionOutput]  # prompt ids -> the turn's one choice
BlobFn = Callable[[list[int], list[int]], np.ndarray]  # (prompt ids, output ids) -> blob


def token_routing(ids: list[int], layers: int = 2, top_k: int = 2) -> np.ndarray:
    """A blob that is a pure function of each position's token id:
    int32 [len(ids) - 1, layers, top_k] (every position but the last is fed to the model)."""
    x = np.asarray(ids[:-1], dtype=np.int32)[:, None, None]
    grid = np.arange(layers, dtype=np.int32)[None, :, None] * top_k + np.arange(top_k)
    return ((x + grid) % 8).astype(np.int32)


def prefix_routing(prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    return token_routing(prompt_ids + output_ids)


class FakeTurnGenerator:
    def __init__(
        self,
        reply: ReplyFn,
        blob: BlobFn | None = prefix_routing,
        gate: asyncio.Event | None = None,
        keep_prompts: bool = True,
        weight_version: int = 0,
        picks: BlobFn | None = None,  # an indexer top-k blob (DSA), as `blob` is routing
    ) -> None:
        self.reply = reply
        self.picks = picks
        self.weight_version = weight_version
        self.blob = blob
        self.gate = gate
        self.keep_prompts = keep_prompts  # off in benchmarks: the copies cost O(turns x prefix)
        self.seen: list[list[int]] = []
        self.in_flight = 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, routing_key: str
    ) -> AsyncGenerator[RequestOutput, None]:
        self.in_flight += 1
        try:
            if self.keep_prompts:
                self.seen.append(list(prompt_ids))
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)  # a real generator yields to the loop
            out = self.reply(prompt_ids)
            # progress, like a stream
            yield self._output(
                prompt_ids, CompletionOutput(0, "", out.token_ids[:1], (out.logprobs or [])[:1])
            )
            out.finish_reason = out.finish_reason or "stop"
            if self.blob is not None and out.finish_reason != "abort":
                out.routed_experts = self.blob(prompt_ids, out.token_ids)
            if self.picks is not None and out.finish_reason != "abort":
                out.indexer_topk = self.picks(prompt_ids, out.token_ids)
            yield self._output(prompt_ids, out)
        finally:
            self.in_flight -= 1

    def _output(self, prompt_ids: list[int], choice: CompletionOutput) -> RequestOutput:
        return RequestOutput(
            "fake", None, prompt_ids, [choice], choice.finished, weight_version=self.weight_version
        )
