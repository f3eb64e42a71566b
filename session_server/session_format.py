"""OpenAI chat bodies for a session turn, by the chat route's own formatter.

A session turn yields `TurnResult`s; `SessionChatFormatter.view` shows each as the one-choice
delta (`EngineCoreOutput`) the formatter reads. The reply's message is the one the session
stored — what the client must echo back next turn — and the reply carries no prompt ids (the
session's records hold them) and no replay blobs.
"""

from __future__ import annotations

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.router.messages import Message
from raylane.router.sessions import TurnResult
from raylane.session_server import formatting as fmt
from raylane.session_server.openai_format import ChatFormatter
from raylane.session_server.schemas import ChatCompletionRequest


class SessionChatFormatter(ChatFormatter):
    body: ChatCompletionRequest  # the session chat route's request
    reply: Message | None = None  # the stored assistant message, once the turn is committed
    prompt_len = 0  # the ids the model saw as the turn's prompt (not shipped to the ingress)
    _sent_tokens = 0
    _sent_chars = 0

    def view(self, result: TurnResult) -> EngineCoreOutput:
        """The turn's progress as the delta the formatter reads: what it added since the
        last view."""
        out = result.output
        n0, c0 = self._sent_tokens, self._sent_chars
        self._sent_tokens, self._sent_chars = len(out.token_ids), len(out.text)
        ids = out.token_ids[n0:]
        asked = self.body.logprobs
        choice = SampleDelta(
            0,
            out.text[c0:],
            ids,
            logprobs=(out.logprobs or [])[n0:] if asked else None,
            top_logprobs=[{}] * len(ids) if asked else None,  # top-n is refused on this route
            finish_reason=out.finish_reason,
        )
        if result.message is not None:
            self.reply = result.message
        self.prompt_len = result.prompt_len
        return EngineCoreOutput(
            self.id, [choice], out.finished, result.weight_version, prompt_token_ids=[]
        )

    def _message(self, c: CompletionOutput) -> dict:
        return dict(self.reply) if self.reply is not None else super()._message(c)

    def _usage(self, finals: list[RequestOutput]) -> dict:
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return fmt.usage_of(self.prompt_len, completion, 0)

    def _stream_usage(self) -> dict:
        return fmt.usage_of(self.prompt_len, self._sent_tokens, 0)

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        body = super().response(finals)
        body.pop("prompt_token_ids", None)
        return body

    def _role_chunk(self, out: EngineCoreOutput) -> dict:
        chunk = super()._role_chunk(out)
        chunk.pop("prompt_token_ids", None)
        return chunk
