"""The LLM the consolidator talks to: a protocol and two implementations.

- `OpenAICompatibleLLM`: any OpenAI-compatible chat endpoint (the cluster's own Serve app).
- `EngineLLM`: an in-process `raylane.actors.engine.AsyncLLMEngine` plus a chat-template tokenizer.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from .errors import CallFailed


@runtime_checkable
class LLM(Protocol):
    """Anything that turns chat messages into the model's answer text."""

    async def complete(
        self, messages: list[dict], *, response_format: dict | None = None
    ) -> str: ...


class OpenAICompatibleLLM:
    """Chat completions at `base_url` (e.g. "http://127.0.0.1:8000/v1") with `model`.

    A 400 (prompt rejected, e.g. too long for the context) is a `CallFailed`, so the batch is
    split; connection errors and 5xx propagate, because a smaller batch would not help.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "EMPTY",
        max_tokens: int = 1024,
        timeout: float = 120.0,
        client: Any = None,
    ) -> None:
        if client is None:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout)
        self._client = client
        self.model = model
        self.max_tokens = max_tokens

    async def complete(self, messages: list[dict], *, response_format: dict | None = None) -> str:
        import openai

        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        if response_format is not None:
            kwargs["response_format"] = response_format
        try:
            response = await self._client.chat.completions.create(**kwargs)
        except openai.BadRequestError as exc:
            raise CallFailed(f"the endpoint rejected the prompt: {exc}") from exc
        return response.choices[0].message.content or ""


def _constrained(params: Any, response_format: dict | None) -> Any:
    if response_format is None or response_format.get("type", "text") == "text":
        return params
    import dataclasses

    from raylane.actors.engine import StructuredOutputsParams

    if response_format["type"] == "json_object":
        spec = StructuredOutputsParams(json_object=True)
    else:
        spec = StructuredOutputsParams(json=response_format["json_schema"]["schema"])
    return dataclasses.replace(params, structured_outputs=spec)


class _Engine(Protocol):
    def generate(self, prompt: str, params: Any, request_id: str) -> AsyncIterator[Any]: ...


class _ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str: ...


def _default_sampling_params(max_tokens: int) -> Any:
    # Imported on first use: the engine (and torch) is only needed when this class is.
    from raylane.actors.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


class EngineLLM:
    """An in-process engine: render the chat template, generate greedily, return the text.

    A `response_format` (OpenAI's json_object / json_schema) constrains the output through
    the engine's structured outputs, as the HTTP endpoint would.
    """

    def __init__(
        self,
        engine: _Engine,
        tokenizer: _ChatTokenizer,
        *,
        max_tokens: int = 1024,
        sampling_params: Callable[[int], Any] = _default_sampling_params,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._sampling_params = sampling_params

    async def complete(self, messages: list[dict], *, response_format: dict | None = None) -> str:
        prompt = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        params = _constrained(self._sampling_params(self.max_tokens), response_format)
        request_id = f"consolidation-{uuid.uuid4().hex}"
        text = ""
        try:
            # Outputs are cumulative: the last one holds the whole answer.
            async for output in self.engine.generate(prompt, params, request_id):
                text = output.outputs[0].text
        except ValueError as exc:  # the engine's answer to a prompt it cannot take
            raise CallFailed(f"the engine rejected the prompt: {exc}") from exc
        return text
