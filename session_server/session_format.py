"""OpenAI chat bodies for a session turn, by the chat route's own formatter.

A session turn yields the engine's deltas (`TurnDelta`s); `SessionChatFormatter.view` passes
each on as the one-choice delta (`EngineCoreOutput`) the formatter reads. The reply's message is
the one the session stored — what the client must echo back next turn — and the reply carries
no prompt ids (the session's records hold them) and no replay blobs.
"""

from __future__ import annotations

from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.router.messages import Message
from raylane.router.session import TurnDelta
from raylane.session_server import formatting as fmt
from raylane.session_server.openai_format import ChatFormatter
from raylane.session_server.schemas import ChatCompletionRequest


class SessionChatFormatter(ChatFormatter):
    body: ChatCompletionRequest  # the session chat route's request
    reply: Message | None = None  # the stored assistant message, once the turn is committed
    prompt_len = 0  # the ids the model saw as the turn's prompt (not shipped to the ingress)
    _sent_tokens = 0

    def view(self, step: TurnDelta) -> EngineCoreOutput:
        """The turn's step as the delta the formatter reads: the engine's own, less what this
        route does not send (the prompt ids, top-n logprobs, replay blobs)."""
        (d,) = step.delta.outputs
        self._sent_tokens += len(d.token_ids)
        asked = self.body.logprobs
        choice = SampleDelta(
            0,
            d.text,
            d.token_ids,
            logprobs=list(d.logprobs or []) if asked else None,
            top_logprobs=[{}] * len(d.token_ids) if asked else None,  # top-n: refused here
            finish_reason=d.finish_reason,
        )
        if step.committed is not None:
            self.reply = step.committed.message
        self.prompt_len = step.prompt_len
        return EngineCoreOutput(
            self.id, [choice], step.delta.finished, step.delta.weight_version, prompt_token_ids=[]
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
