"""Shared pieces of the session tests: a registry over the tiny tokenizer and a fake generator,
and an agent-like client that echoes the conversation back each turn."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from raylane.actors.engine.outputs import CompletionOutput
from raylane.router.sessions import SessionConfig, SessionRegistry
from raylane.router.tito import TemplateSplicer

from tests.support.fake_generator import FakeTurnGenerator


def logprobs_for(ids: list[int]) -> list[float]:
    return [-(t % 7 + 1) / 8 for t in ids]


def make_registry(
    tok: Any,
    config: SessionConfig | None = None,
    gate: asyncio.Event | None = None,
    finish_reason: str | None = None,
    canonical: bool = True,
    picks=None,
) -> tuple[SessionRegistry, FakeTurnGenerator]:
    """Replies are "reply N" (N counts calls), as canonical ids + eos, or one id per character
    (a valid but non-canonical tokenization, as a sampled model may produce)."""
    counter = itertools.count()

    def reply(prompt_ids: list[int]) -> CompletionOutput:
        text = f"reply {next(counter)}"
        if canonical:
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = [tok.convert_tokens_to_ids(tok.tokenize(c)[0]) for c in text]
        if finish_reason in (None, "stop"):
            ids = ids + [tok.eos_token_id]
        return CompletionOutput(0, text, ids, logprobs_for(ids), finish_reason=finish_reason)

    gen = FakeTurnGenerator(reply, gate=gate, weight_version=7, picks=picks)
    return SessionRegistry(TemplateSplicer(tok), gen, config), gen


class Agent:
    """Keeps the conversation client-side, as an OpenAI-style agent does."""

    def __init__(self, registry: SessionRegistry, session_id: str) -> None:
        self.registry = registry
        self.id = session_id
        self.messages: list[dict] = []

    @classmethod
    async def start(
        cls, registry: SessionRegistry, metadata: dict[str, Any] | None = None
    ) -> Agent:
        """An agent on a new session of `registry`."""
        return cls(registry, await registry.create(metadata))

    async def say(self, *messages: dict, **kwargs: Any):
        self.messages += messages
        result = await self.registry.chat(self.id, list(self.messages), **kwargs)
        self.messages.append(result.message)
        return result

    async def user(self, text: str, **kwargs: Any):
        return await self.say({"role": "user", "content": text}, **kwargs)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def rendered(
    tok: Any, messages: list[dict], generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """The independent reference: the template renders the whole conversation at once."""
    ids = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
