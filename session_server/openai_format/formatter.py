"""What the chat and (legacy) completions formatters share: the response head, the deltas a
stream step adds per choice (`ChoiceCursor`, `PromptSeen`), usage, and the per-choice extras."""

from __future__ import annotations

import time

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server import formatting as fmt
from raylane.session_server.schemas import OpenAISampling
from raylane.session_server.streaming import ChoiceCursor, Delta, PromptSeen


class Formatter:
    object = ""
    chunk_object = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        body: OpenAISampling,
        params: SamplingParams,
        tokenizer,
        num_top: int,
    ):
        self.id = request_id
        self.created = int(time.time())
        self.model = model
        self.body = body
        self.params = params
        self.tokenizer = tokenizer
        # what names tokens in logprobs: their text, or "token_id:<id>" (vLLM's
        # return_tokens_as_token_ids, which TRL's client asks for)
        self.namer = fmt.TokenIds() if body.return_tokens_as_token_ids else tokenizer
        self.num_top = num_top
        self.cursors: dict[tuple[int, int], ChoiceCursor] = {}
        self.seen: dict[int, PromptSeen] = {}  # streaming: by prompt index
        self.version = 0  # the newest weight version seen in the outputs

    def _head(self, kind: str) -> dict:
        # weight_version: an extension (RL trainers check which weights answered)
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "weight_version": self.version,
        }

    def _saw(self, outs: list[RequestOutput] | list[EngineCoreOutput]) -> None:
        self.version = max([self.version, *(o.weight_version for o in outs)])

    def _extras(
        self, choice: dict, c: CompletionOutput | SampleDelta, token_ids: list[int]
    ) -> dict:
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        if self.body.return_routed_experts and c.finished:
            choice["routed_experts"] = fmt.routed_experts(c.routed_experts)
        if self.body.return_indexer_topk and c.finished:
            choice["indexer_topk"] = fmt.routed_experts(c.indexer_topk)
        return choice

    def _deltas(self, i: int, out: EngineCoreOutput) -> list[tuple[int, SampleDelta, Delta]]:
        self.seen.setdefault(i, PromptSeen()).add(out)
        self._saw([out])
        found = []
        for c in out.outputs:
            cursor = self.cursors.setdefault((i, c.index), ChoiceCursor())
            delta = cursor.advance(c)
            if delta is not None and (delta.text or delta.finished or self._token_level):
                found.append((i * self.params.n + c.index, c, delta))
        return found

    @property
    def _token_level(self) -> bool:
        """Chunks without text still matter when they carry token ids or logprobs."""
        return self.body.return_token_ids or self.params.logprobs is not None

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self._head(self.chunk_object), "choices": choices}
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk

    def tail(self) -> list[dict]:
        """After the last output: the usage chunk when `stream_options.include_usage`."""
        if not self.body.include_usage:
            return []
        usage = self._stream_usage()
        return [{**self._head(self.chunk_object), "choices": [], "usage": usage}]

    def _stream_usage(self) -> dict:
        seen = self.seen.values()
        return fmt.usage_of(
            sum(len(p.prompt_token_ids) for p in seen),
            sum(p.completion_tokens for p in seen),
            sum(p.num_cached_tokens for p in seen),
        )

    def _usage(self, finals: list[RequestOutput]) -> dict:
        return fmt.usage(finals)

    def _choices(
        self, finals: dict[int, RequestOutput]
    ) -> list[tuple[int, RequestOutput, CompletionOutput]]:
        return [
            (i * self.params.n + c.index, finals[i], c)
            for i in sorted(finals)
            for c in finals[i].outputs
        ]
