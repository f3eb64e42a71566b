"""The chat completions response and stream chunks: the role chunk first, and tool calls read
from the text when the request has tools (`ToolPlan`)."""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.session_server import formatting as fmt
from raylane.session_server.openai_format.formatter import Formatter
from raylane.session_server.streaming import Delta
from raylane.session_server.tool_calls import ToolParser, openai_deltas
from raylane.session_server.tool_calls.choice import ToolPlan


class ChatFormatter(Formatter):
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: ToolPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools  # None: the text is the message, no tool calls are read from it
        self.parsers: dict[tuple[int, int], ToolParser] = {}  # streamed choices' parsers

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        out0 = finals[0]
        self._saw([out0])
        choices = [self._choice(idx, c) for idx, _, c in self._choices(finals)]
        body = {
            **self._head("chat.completion"),
            "system_fingerprint": None,
            "choices": choices,
            "usage": self._usage([out0]),
        }
        if self.body.return_token_ids:
            body["prompt_token_ids"] = out0.prompt_token_ids
        return body

    def _choice(self, idx: int, c: CompletionOutput) -> dict:
        message = self._message(c)
        reason = c.finish_reason
        if self.tools is not None:
            reason = self.tools.finish_reason(reason, "tool_calls" in message)
        choice = {
            "index": idx,
            "message": message,
            "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
        }
        return self._extras(choice, c, c.token_ids)

    def _message(self, c: CompletionOutput) -> dict:
        if self.tools is None:
            return {"role": "assistant", "content": c.text}
        content, calls = self.tools.new_parser().parse(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message

    def chunks(self, i: int, out: EngineCoreOutput) -> list[dict]:
        chunks = [] if self.seen else [self._role_chunk(out)]
        for idx, c, d in self._deltas(i, out):
            deltas = self._message_deltas(i, c, d)
            if not deltas and not (d.finished or self._token_level):
                continue  # the tool-call parser holds the text back for now
            # a delta with several message pieces: all but the last go out on their own
            chunks += [
                self._chunk(
                    [{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
                for delta in deltas[:-1]
            ]
            choice = {
                "index": idx,
                "delta": deltas[-1] if deltas else {},
                "logprobs": self._logprobs(d.token_ids, d.logprobs, d.top_logprobs),
                "finish_reason": self._stream_finish(i, c) if d.finished else None,
            }
            if d.finished:
                choice["stop_reason"] = c.stop_reason
            chunks.append(self._chunk([self._extras(choice, c, d.token_ids)]))
        return chunks

    def _message_deltas(self, i: int, c: SampleDelta, d: Delta) -> list[dict]:
        if self.tools is None:
            return [{"content": d.text}] if d.text else []
        parser = self.parsers.setdefault((i, c.index), self.tools.new_parser())
        return openai_deltas(parser.feed(d.text) + (parser.finish() if d.finished else []))

    def _stream_finish(self, i: int, c: SampleDelta) -> str | None:
        if self.tools is None:
            return c.finish_reason
        return self.tools.finish_reason(c.finish_reason, self.parsers[(i, c.index)].called)

    def _role_chunk(self, out: EngineCoreOutput) -> dict:
        """The first chunk names the role of every choice, as OpenAI's stream does."""
        self._saw([out])
        chunk = self._chunk(
            [
                {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for j in range(self.params.n)
            ]
        )
        if self.body.return_token_ids:
            chunk["prompt_token_ids"] = out.prompt_token_ids
        return chunk

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if logprobs is None:
            return None
        return fmt.chat_logprobs(self.namer, ids, logprobs, tops, self.num_top)
