"""OpenAI response bodies and stream chunks for one request, chat and (legacy) completions.

A formatter is built per request. A non-streaming response reads each prompt's cumulative
output; a stream reads the engine's deltas as they come, remembering what each choice has sent
(`ChoiceCursor`) and what each prompt told so far (`PromptSeen`, for the usage chunk).
"""

from __future__ import annotations

import dataclasses
import time
from itertools import accumulate
from typing import Any

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
from raylane.session_server.tool_calls import ToolParser, openai_deltas
from raylane.session_server.tool_calls.choice import ToolPlan


class _Formatter:
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


@dataclasses.dataclass(frozen=True)
class Echo:
    """`echo: true` (/v1/completions): each choice's text and logprobs start with its prompt's."""

    texts: list[str]  # the prompt text as sent (decoded when sent as token ids), by prompt index
    # max_tokens 0: the engine needs max_tokens >= 1, so the request runs with 1 and the token
    # it generates is dropped here (no text, logprob or usage; finish reason "length")
    prompt_only: bool = False


class CompletionFormatter(_Formatter):
    chunk_object = "text_completion"

    def __init__(self, *args, echo: Echo | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._echoed: set[int] = set()  # streamed choices whose prompt part went out

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        finals = {i: self._shown(out) for i, out in finals.items()}
        self._saw(list(finals.values()))
        choices = [self._choice(idx, out, c) for idx, out, c in self._choices(finals)]
        return {
            **self._head("text_completion"),
            "system_fingerprint": None,
            "choices": choices,
            "usage": fmt.usage([finals[i] for i in sorted(finals)]),
        }

    def _choice(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict:
        prefix, prefix_lp = self._prompt_part(idx // self.params.n, out)
        choice = {
            "index": idx,
            "text": prefix + c.text,
            "logprobs": _joined(
                prefix_lp, self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, len(prefix))
            ),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
        return self._extras(choice, c, c.token_ids)

    def chunks(self, i: int, out: EngineCoreOutput) -> list[dict]:
        out = self._shown(out)
        deltas = {idx: (c, d) for idx, c, d in self._deltas(i, out)}
        choices = []
        for c in out.outputs:
            idx = i * self.params.n + c.index
            # with echo, a choice's first chunk carries its prompt (vLLM's stream does the same)
            echo_now = self.echo is not None and idx not in self._echoed
            if idx in deltas or echo_now:
                self._echoed.add(idx)
                c, d = deltas.get(idx, (c, None))
                choices.append(self._stream_choice(i, idx, out, c, d, echo_now))
        return [self._chunk([ch]) for ch in choices]

    def _stream_choice(
        self,
        i: int,
        idx: int,
        out: EngineCoreOutput,
        c: SampleDelta,
        d: Delta | None,
        echo_now: bool,
    ) -> dict:
        if d is None:  # the prompt part alone: the choice has nothing new yet
            none: list | None = [] if c.logprobs is not None else None
            d = Delta("", [], none, none, 0, False, False)
        prefix, prefix_lp = self._prompt_part(i, self.seen[i]) if echo_now else ("", None)
        shift = len(self.echo.texts[i]) if self.echo is not None else 0
        lp = self._logprobs(d.token_ids, d.logprobs, d.top_logprobs, d.text_offset + shift)
        choice = {
            "index": idx,
            "text": prefix + d.text,
            "logprobs": _joined(prefix_lp, lp),
            "finish_reason": c.finish_reason if d.finished else None,
            "stop_reason": c.stop_reason if d.finished else None,
        }
        if self.body.return_token_ids and (echo_now if self.echo is not None else d.first):
            choice["prompt_token_ids"] = self.seen[i].prompt_token_ids
        return self._extras(choice, c, d.token_ids)

    def _prompt_part(self, i: int, out: RequestOutput | PromptSeen) -> tuple[str, dict | None]:
        """What echo puts before prompt i's completion: its text, and its logprobs when asked."""
        if self.echo is None:
            return "", None
        if self.params.logprobs is None:
            return self.echo.texts[i], None
        return self.echo.texts[i], _prompt_logprobs(self.namer, out)

    def _shown(self, out):
        """`out` (a cumulative output or a delta) as the response shows it."""
        return _prompt_only(out) if self.echo is not None and self.echo.prompt_only else out

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if logprobs is None:
            return None
        return fmt.completion_logprobs(self.namer, ids, logprobs, tops, self.num_top, offset)


def _prompt_logprobs(tokenizer, out: RequestOutput | PromptSeen) -> dict:
    """The legacy `logprobs` of the prompt tokens. The first token has none (nothing precedes
    it); each later one's top_logprobs holds the top-N and the token itself, as vLLM's do."""
    ids = out.prompt_token_ids
    entries = list(out.prompt_logprobs or [])
    entries += [None] * (len(ids) - len(entries))  # ended (deadline) before its prefill ran
    tokens = [fmt.token_text(tokenizer, t) for t in ids]
    tops = [
        None
        if e is None
        else {
            fmt.token_text(tokenizer, a): fmt.finite(lp)
            for a, lp in sorted(e.items(), key=lambda kv: -kv[1])
        }
        for e in entries
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else fmt.finite(e[t]) for t, e in zip(ids, entries)],
        "top_logprobs": tops,
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=0)),
    }


def _prompt_only(out):
    """`out` (a `RequestOutput` or an `EngineCoreOutput`) without its generated token (see
    `Echo.prompt_only`)."""
    samples = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            weight_versions=[],
            stop_reason=None,
            logprobs=None if c.logprobs is None else [],
            top_logprobs=None if c.top_logprobs is None else [],
            kept_mass_logprobs=None if c.kept_mass_logprobs is None else [],
            finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=samples)


def _joined(head: dict | None, tail: dict | None) -> dict | None:
    """Two legacy logprobs objects as one (the prompt's, then the completion's)."""
    if head is None or tail is None:
        return tail
    return {key: head[key] + tail[key] for key in head}


class ChatFormatter(_Formatter):
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
