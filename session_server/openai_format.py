"""OpenAI response bodies and stream chunks for one request, chat and (legacy) completions.

A formatter is built per request; while streaming it remembers what each choice has sent
(`ChoiceCursor`) and the last output of each prompt (for the usage chunk).
"""

from __future__ import annotations

import time

from actors.engine.outputs import CompletionOutput, RequestOutput
from actors.engine.sampling_params import SamplingParams
from session_server import formatting as fmt
from session_server.schemas import OpenAISampling
from session_server.streaming import ChoiceCursor, Delta, hold_for


class _Formatter:
    object = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, body: OpenAISampling,
                 params: SamplingParams, tokenizer, num_top: int):
        self.id = request_id
        self.created = int(time.time())
        self.model = model
        self.body = body
        self.params = params
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.cursors: dict[tuple[int, int], ChoiceCursor] = {}
        self.last: dict[int, RequestOutput] = {}
        self.version = 0  # the newest weight version seen in the outputs

    def _head(self, kind: str) -> dict:
        # weight_version: an extension (RL trainers check which weights answered)
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "weight_version": self.version}

    def _saw(self, outs: list[RequestOutput]) -> None:
        self.version = max([self.version, *(o.weight_version for o in outs)])

    def _extras(self, choice: dict, c: CompletionOutput, token_ids: list[int]) -> dict:
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        if self.body.return_routed_experts and c.finished:
            choice["routed_experts"] = fmt.routed_experts(c.routed_experts)
        return choice

    def _deltas(self, i: int, out: RequestOutput) -> list[tuple[int, CompletionOutput, Delta]]:
        self.last[i] = out
        self._saw([out])
        found = []
        for c in out.outputs:
            cursor = self.cursors.setdefault((i, c.index), ChoiceCursor(hold_for(self.params)))
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
        usage = self._usage([self.last[i] for i in sorted(self.last)])
        return [{**self._head(self.chunk_object), "choices": [], "usage": usage}]

    def _usage(self, finals: list[RequestOutput]) -> dict:
        return fmt.usage(finals)

    def _choices(self, finals: dict[int, RequestOutput]) -> list[tuple[int, RequestOutput,
                                                                      CompletionOutput]]:
        return [(i * self.params.n + c.index, finals[i], c) for i in sorted(finals)
                for c in finals[i].outputs]


class CompletionFormatter(_Formatter):
    chunk_object = "text_completion"

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        self._saw(list(finals.values()))
        choices = [self._choice(idx, out, c) for idx, out, c in self._choices(finals)]
        return {**self._head("text_completion"), "system_fingerprint": None, "choices": choices,
                "usage": fmt.usage([finals[i] for i in sorted(finals)])}

    def _choice(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict:
        choice = {"index": idx, "text": c.text,
                  "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
        return self._extras(choice, c, c.token_ids)

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        choices = []
        for idx, c, d in self._deltas(i, out):
            choice = {"index": idx, "text": d.text,
                      "logprobs": self._logprobs(d.token_ids, d.logprobs, d.top_logprobs,
                                                 d.text_offset),
                      "finish_reason": c.finish_reason if d.finished else None,
                      "stop_reason": c.stop_reason if d.finished else None}
            if self.body.return_token_ids and d.first:
                choice["prompt_token_ids"] = out.prompt_token_ids
            choices.append(self._extras(choice, c, d.token_ids))
        return [self._chunk([ch]) for ch in choices]

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if logprobs is None:
            return None
        return fmt.completion_logprobs(self.tokenizer, ids, logprobs, tops, self.num_top, offset)


class ChatFormatter(_Formatter):
    chunk_object = "chat.completion.chunk"

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        out0 = finals[0]
        self._saw([out0])
        choices = [self._choice(idx, c) for idx, _, c in self._choices(finals)]
        body = {**self._head("chat.completion"), "system_fingerprint": None, "choices": choices,
                "usage": self._usage([out0])}
        if self.body.return_token_ids:
            body["prompt_token_ids"] = out0.prompt_token_ids
        return body

    def _choice(self, idx: int, c: CompletionOutput) -> dict:
        choice = {"index": idx, "message": self._message(c),
                  "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return self._extras(choice, c, c.token_ids)

    def _message(self, c: CompletionOutput) -> dict:
        return {"role": "assistant", "content": c.text}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        chunks = [] if self.last else [self._role_chunk(out)]
        for idx, c, d in self._deltas(i, out):
            choice = {"index": idx, "delta": {"content": d.text} if d.text else {},
                      "logprobs": self._logprobs(d.token_ids, d.logprobs, d.top_logprobs),
                      "finish_reason": c.finish_reason if d.finished else None}
            if d.finished:
                choice["stop_reason"] = c.stop_reason
            chunks.append(self._chunk([self._extras(choice, c, d.token_ids)]))
        return chunks

    def _role_chunk(self, out: RequestOutput) -> dict:
        """The first chunk names the role of every choice, as OpenAI's stream does."""
        self._saw([out])
        chunk = self._chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for j in range(self.params.n)])
        if self.body.return_token_ids:
            chunk["prompt_token_ids"] = out.prompt_token_ids
        return chunk

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if logprobs is None:
            return None
        return fmt.chat_logprobs(self.tokenizer, ids, logprobs, tops, self.num_top)
