"""OpenAI chat bodies for a session turn, by the chat route's own formatter.

A session turn yields `TurnResult`s; `SessionChatFormatter.view` shows each as the one-choice
`RequestOutput` the formatter reads. The reply's message is the one the session stored — what
the client must echo back next turn — and the reply carries no prompt ids (the session's records
hold them) and no replay blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.router.messages import Message
from raylane.router.sessions import TurnResult
from raylane.session_server.openai_format import ChatFormatter


@dataclass
class TurnView(RequestOutput):
    prompt_len: int = 0  # the ids the model saw as the turn's prompt (not shipped to the ingress)


class SessionChatFormatter(ChatFormatter):
    reply: Message | None = None  # the stored assistant message, once the turn is committed

    def view(self, result: TurnResult) -> TurnView:
        out = result.output
        ids = list(out.token_ids)
        asked = self.body.logprobs
        choice = CompletionOutput(
            0,
            out.text,
            ids,
            logprobs=list(out.logprobs) if asked else None,
            top_logprobs=[{}] * len(ids) if asked else None,  # top-n is refused on this route
            finish_reason=out.finish_reason,
        )
        if result.message is not None:
            self.reply = result.message
        return TurnView(
            self.id,
            None,
            [],
            [choice],
            out.finished,
            0,
            result.weight_version,
            prompt_len=result.prompt_len,
        )

    def _message(self, c: CompletionOutput) -> dict:
        return dict(self.reply) if self.reply is not None else super()._message(c)

    def _usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(o.prompt_len for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def response(self, finals: dict[int, RequestOutput]) -> dict:
        body = super().response(finals)
        body.pop("prompt_token_ids", None)
        return body

    def _role_chunk(self, out: RequestOutput) -> dict:
        chunk = super()._role_chunk(out)
        chunk.pop("prompt_token_ids", None)
        return chunk
