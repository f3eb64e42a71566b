"""Tool calls over HTTP with the official openai client, on the tiny Llama (random weights).

"auto" reads calls the real engine wrote: a structured output (`choice`) forces the model's text
to an exact Hermes or Llama 3 string. "required" and a named function constrain the arguments to
the tools' schemas (checked with jsonschema). Tool results and assistant tool calls round-trip
through the chat template and a session turn; bad tools and tool_choice are 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import Backend, local_backend

from tests.e2e.server import ServerThread

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Berlin", "Paris"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Berlin?"}]
CALL_1 = '{"name": "get_weather", "arguments": {"city": "Berlin", "days": 2}}'
CALL_2 = '{"name": "get_time", "arguments": {"zone": "CET"}}'
HERMES = f"Let me check.\n<tool_call>\n{CALL_1}\n</tool_call>"
HERMES_2 = f"<tool_call>\n{CALL_1}\n</tool_call>\n<tool_call>\n{CALL_2}\n</tool_call>"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def forced(text: str) -> dict:
    """extra_body that makes the engine write exactly `text` (then end)."""
    return {"structured_outputs": {"choice": [text]}}


def engine_backend(model_dir: str) -> Backend:
    # tool definitions make long prompts in the tiny vocabulary
    config = EngineConfig(model=model_dir, num_kv_blocks=256, max_model_len=1024)
    return local_backend(AsyncLLMEngine(LLMEngine(config)), MODEL)


@pytest.fixture(scope="module")
def backend(tiny_llama_dir) -> Backend:
    return engine_backend(tiny_llama_dir)


@pytest.fixture(scope="module")
def server(backend) -> Iterator[ServerThread]:
    with ServerThread(build_app(backend)) as srv:  # hermes: the template shows <tool_call>
        yield srv


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 300,
        "temperature": 0,
        **kwargs,
    }
    return client.chat.completions.create(**kwargs)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def collect(chunks) -> tuple[str, dict[int, dict], list]:
    """A stream as the client rebuilds it: content, calls by index, and the finish reasons."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        choice = chunk.choices[0]
        finishes.append(choice.finish_reason)
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or []:
            call = calls.setdefault(entry.index, {"entries": [], "arguments": ""})
            call["entries"].append(entry)
            call["arguments"] += entry.function.arguments or ""
    return content, calls, finishes


def test_auto_reads_the_hermes_call_the_model_wrote(client):
    choice = chat(client, extra_body=forced(HERMES)).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Berlin", "days": 2})]
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.arguments == '{"city": "Berlin", "days": 2}'  # as the model wrote it


def test_auto_streams_content_then_the_call_as_openai_does(client):
    whole = chat(client, extra_body=forced(HERMES)).choices[0].message
    chunks = list(chat(client, extra_body=forced(HERMES), stream=True))
    content, calls, finishes = collect(chunks)
    assert content == "Let me check."
    assert list(calls) == [0]
    first, *rest = calls[0]["entries"]
    assert first.id.startswith("call_") and first.type == "function"
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert len(rest) > 2 and all(e.id is None and e.function.name is None for e in rest)
    assert calls[0]["arguments"] == whole.tool_calls[0].function.arguments
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_and_parallel_tool_calls_false(client, stream):
    want = [("get_weather", {"city": "Berlin", "days": 2}), ("get_time", {"zone": "CET"})]
    for parallel, n in ((True, 2), (False, 1)):
        got = chat(client, extra_body=forced(HERMES_2), parallel_tool_calls=parallel, stream=stream)
        if stream:
            content, calls, finishes = collect(got)
            found = [
                (calls[i]["entries"][0].function.name, json.loads(calls[i]["arguments"]))
                for i in sorted(calls)
            ]
            assert (content, finishes[-1]) == ("", "tool_calls")
        else:
            message = got.choices[0].message
            found = calls_of(message)
            assert message.content is None and got.choices[0].finish_reason == "tool_calls"
        assert found == want[:n]


def test_tool_choice_none_leaves_the_text_and_still_shows_the_tools(http, backend):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 300,
        "return_token_ids": True,
        **forced(HERMES),
    }
    got = http.post("/v1/chat/completions", json=body).json()
    choice = got["choices"][0]
    assert choice["message"]["content"] == HERMES and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    want = backend.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert got["prompt_token_ids"] == backend.tokenizer.encode(want, add_special_tokens=False)


def test_named_function_arguments_follow_its_schema_streamed_or_not(client):
    got = chat(client, tool_choice=NAMED)
    choice = got.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a named tool_choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finishes = collect(chat(client, tool_choice=NAMED, stream=True))
    assert content == "" and list(calls) == [0] and finishes[-1] == "stop"
    assert calls[0]["entries"][0].function.name == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_tools_with_valid_arguments(client, parallel):
    got = chat(client, tool_choice="required", parallel_tool_calls=parallel)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) >= 1 if parallel else len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, streamed, _ = collect(
        chat(client, tool_choice="required", parallel_tool_calls=parallel, stream=True)
    )
    assert [s["arguments"] for s in streamed.values()] == [c.function.arguments for c in calls]


def test_llama3_parser_from_the_setting(tiny_llama_dir):
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    with ServerThread(build_app(engine_backend(tiny_llama_dir), tool_call_parser="llama3")) as srv:
        llama = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        choice = chat(llama, extra_body=forced(text)).choices[0]
        assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 3})]
        assert choice.finish_reason == "tool_calls"
        content, calls, _ = collect(chat(llama, extra_body=forced(text), stream=True))
        assert calls[0]["arguments"] == '{"city": "Paris", "days": 3}' and content == ""
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(engine_backend(tiny_llama_dir), tool_call_parser="mistral")


def test_hermes_server_leaves_llama3_json_as_text(client):
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    message = chat(client, extra_body=forced(text)).choices[0].message
    assert message.content == text and not message.tool_calls


HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Berlin", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_tool_results_round_trip_through_the_template(client, backend):
    got = chat(client, messages=HISTORY, max_tokens=4, extra_body={"return_token_ids": True})
    # the template gets the arguments as an object, as the model wrote them
    rendered = [dict(m) for m in HISTORY]
    rendered[1] = {
        **HISTORY[1],
        "tool_calls": [
            {
                **HISTORY[1]["tool_calls"][0],
                "function": {"name": "get_weather", "arguments": {"city": "Berlin", "days": 2}},
            }
        ],
    }
    text = backend.tokenizer.apply_chat_template(
        rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert f"<tool_call>\n{CALL_1}\n</tool_call>" in text and '{"temp": 21}' in text
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    assert got.model_extra["prompt_token_ids"] == ids


def test_a_session_turn_takes_tool_calls_and_results(http):
    session = http.post("/sessions", json={}).json()["session_id"]
    body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 4}
    reply = http.post(f"/sessions/{session}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    turn = {
        "messages": HISTORY
        + [reply.json()["choices"][0]["message"], {"role": "user", "content": "And Paris?"}],
        "tools": TOOLS,
        "max_tokens": 4,
    }
    again = http.post(f"/sessions/{session}/v1/chat/completions", json=turn)
    assert again.status_code == 200, again.text
    assert http.get(f"/sessions/{session}").json()["num_turns"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": NAMED | {"function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": None, "tool_choice": NAMED}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": 3}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(http, body, param):
    got = http.post(
        "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4, **body}
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
