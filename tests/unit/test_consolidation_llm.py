"""The two LLM implementations against stand-ins for an endpoint and an engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from raylane.actors.consolidation import CallFailed, EngineLLM, OpenAICompatibleLLM
from raylane.actors.consolidation.prompt import JSON_RESPONSE_FORMAT

MESSAGES = [{"role": "user", "content": "hi"}]


def endpoint(status: int, seen: list[dict]) -> OpenAICompatibleLLM:
    from openai import AsyncOpenAI

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "nope", "type": "x"}})
        return httpx.Response(
            200,
            json={
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": '{"actions": []}'},
                    }
                ],
            },
        )

    client = AsyncOpenAI(
        base_url="http://llm.test/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handle)),
    )
    return OpenAICompatibleLLM("http://llm.test/v1", "m", max_tokens=64, client=client)


async def test_openai_endpoint_asks_for_json() -> None:
    seen: list[dict] = []
    text = await endpoint(200, seen).complete(MESSAGES, response_format=JSON_RESPONSE_FORMAT)
    assert text == '{"actions": []}'
    (body,) = seen
    assert body["response_format"] == JSON_RESPONSE_FORMAT
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("m", 0.0, 64)
    assert body["messages"] == MESSAGES


async def test_rejected_prompt_is_a_failed_call_but_outage_is_not() -> None:
    with pytest.raises(CallFailed):
        await endpoint(400, []).complete(MESSAGES)
    with pytest.raises(Exception) as info:
        await endpoint(503, []).complete(MESSAGES)
    assert not isinstance(info.value, CallFailed)


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        assert tokenize is False and add_generation_prompt is True
        return "|".join(m["content"] for m in messages) + "|assistant:"


class FakeEngine:
    def __init__(self, pieces: list[str] | None = None, error: Exception | None = None):
        self.pieces, self.error, self.requests = pieces or [], error, []

    async def generate(self, prompt, params, request_id):
        self.requests.append((prompt, params, request_id))
        if self.error:
            raise self.error
        text = ""
        for piece in self.pieces:  # cumulative outputs, like AsyncLLMEngine
            text += piece
            yield SimpleNamespace(outputs=[SimpleNamespace(text=text)])


def params(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens}


async def test_engine_llm_returns_the_final_cumulative_text() -> None:
    engine = FakeEngine(['{"act', 'ions": ', "[]}"])
    llm = EngineLLM(engine, FakeTokenizer(), max_tokens=32, sampling_params=params)
    assert await llm.complete(MESSAGES) == '{"actions": []}'
    ((prompt, sent, request_id),) = engine.requests
    assert prompt == "hi|assistant:" and sent == params(32)
    assert request_id.startswith("consolidation-")


async def test_engine_llm_constrains_the_output_to_the_response_format() -> None:
    from raylane.actors.consolidation.prompt import answer_format
    from raylane.actors.engine import SamplingParams, StructuredOutputsParams

    schema_format = answer_format([1, 2], [9])
    for response_format, spec in (
        (JSON_RESPONSE_FORMAT, StructuredOutputsParams(json_object=True)),
        (schema_format, StructuredOutputsParams(json=schema_format["json_schema"]["schema"])),
        (None, None),
        ({"type": "text"}, None),
    ):
        engine = FakeEngine(["{}"])
        await EngineLLM(engine, FakeTokenizer(), max_tokens=32).complete(
            MESSAGES, response_format=response_format
        )
        ((_, sent, _),) = engine.requests
        assert isinstance(sent, SamplingParams) and sent.max_tokens == 32
        assert sent.structured_outputs == spec


async def test_engine_rejecting_the_prompt_is_a_failed_call() -> None:
    llm = EngineLLM(
        FakeEngine(error=ValueError("prompt too long")), FakeTokenizer(), sampling_params=params
    )
    with pytest.raises(CallFailed, match="too long"):
        await llm.complete(MESSAGES)
