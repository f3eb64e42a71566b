"""Tool-call parsers (session_server/tool_calls): whole outputs, and streams cut anywhere that add
up to the same content and arguments; the request side (tool_choice -> schema, finish reason);
the --tool-call-parser setting."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from raylane.actors.engine.detokenizer import IncrementalDetokenizer
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server.errors import APIError
from raylane.session_server.schemas import ChatCompletionRequest
from raylane.session_server.tool_calls import (
    ArgsPiece,
    CallStart,
    Content,
    HermesParser,
    JsonCallsParser,
    Llama3Parser,
    NamedParser,
    ToolParser,
    detect_parser,
    make_parser,
    openai_deltas,
)
from raylane.session_server.tool_calls.choice import tool_plan

from tests.tiny_models import CHAT_TEMPLATE, make_tokenizer

WEATHER = '{"name": "get_weather", "arguments": {"city": "Berlin", "days": [1, {"x": "}"}]}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET \\"summer\\""}}'
HERMES = f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)
REQUIRED = (
    '[{"name":"get_weather","arguments":{"city":"Berlin"}},{"name":"get_time","arguments":{}}]'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def calls(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, found = parser.parse(text)
    return content, [(c.name, c.arguments) for c in found]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client rebuilds from the stream's events (content, then (name, arguments) each)."""
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    args = {
        i: "".join(e.text for e in events if isinstance(e, ArgsPiece) and e.index == i)
        for i in names
    }
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content or None, [(names[i], args[i]) for i in sorted(names)]


def test_hermes_one_call_with_text_before():
    text = f"I will look it up.\n<tool_call>\n{WEATHER}\n</tool_call>"
    assert calls(HermesParser(), text) == (
        "I will look it up.",
        [("get_weather", '{"city": "Berlin", "days": [1, {"x": "}"}]}')],
    )


def test_hermes_two_calls_and_a_limit_of_one():
    want = [
        ("get_weather", '{"city": "Berlin", "days": [1, {"x": "}"}]}'),
        ("get_time", '{"zone": "CET \\"summer\\""}'),
    ]
    assert calls(HermesParser(), HERMES) == ("Let me check.", want)
    assert calls(HermesParser(limit=1), HERMES) == ("Let me check.", want[:1])
    parsed = HermesParser().parse(HERMES)[1]
    assert all(json.loads(c.arguments) for c in parsed)
    assert all(c.id.startswith("call_") and len(c.id) > 20 for c in parsed)
    assert len({c.id for c in parsed}) == 2


def test_hermes_call_alone_has_no_content_and_keys_in_any_order():
    text = '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>\n'
    assert calls(HermesParser(), text) == (None, [("f", '{"a": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        "no calls here, only text",
        "<tool_call> not json </tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off inside the call
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}, }\n</tool_call>',  # not JSON
        '<tool_call>\n{"function": "f"}\n</tool_call>',  # not a call
        '<tool_call>\n["f"]\n</tool_call>',
        "a < b and <tool_ca",
        "",
    ],
)
def test_hermes_malformed_or_absent_calls_stay_text(text):
    assert calls(HermesParser(), text) == (text, [])


def test_llama3_calls_after_the_python_tag():
    assert calls(Llama3Parser(), LLAMA3) == (
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    )
    assert calls(Llama3Parser(), '{"name": "f", "parameters": {"a": [1, 2]}}') == (
        None,
        [("f", '{"a": [1, 2]}')],
    )


@pytest.mark.parametrize(
    "text", ["Paris is the capital.", '{"answer": 42}', " {not json", '{"name": "f"}']
)
def test_llama3_text_and_other_json_stay_text(text):
    assert calls(Llama3Parser(), text) == (text, [])


def test_required_array_and_single_object():
    want = [("get_weather", '{"city":"Berlin"}'), ("get_time", "{}")]
    assert calls(JsonCallsParser(), REQUIRED) == (None, want)
    assert calls(JsonCallsParser(limit=1), '{"name":"get_time","arguments":{}}') == (None, want[1:])


def test_named_call_is_the_whole_output():
    assert calls(NamedParser("f"), '{"a":1}') == (None, [("f", '{"a":1}')])


CASES = [
    (HermesParser, HERMES),
    (HermesParser, "plain text <with> a tag-like <tool_ bit"),
    (Llama3Parser, LLAMA3),
    (Llama3Parser, "Paris."),
    (JsonCallsParser, REQUIRED),
    (lambda: NamedParser("f"), '{"a": [1, "x"]}'),
]


@pytest.mark.parametrize(("make", "text"), CASES)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_stream_cut_anywhere_equals_the_whole(make, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert streamed(make(), pieces) == calls(make(), text)


@pytest.mark.parametrize(("make", "text"), CASES)
def test_stream_of_real_token_pieces_equals_the_whole(make, text):
    """The pieces the engine's detokenizer emits for the text's tokens, one token at a time."""
    tokenizer = make_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.step(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == text
    assert len(pieces) > 2  # really cut
    assert streamed(make(), pieces) == calls(make(), text)


def test_openai_deltas_start_each_call_then_stream_its_arguments():
    parser = HermesParser()
    feeds = ["Hi.\n<tool_call>\n" + WEATHER[:40], WEATHER[40:], "\n</tool_call>"]
    deltas = [d for f in feeds for d in openai_deltas(parser.feed(f))]
    deltas += openai_deltas(parser.finish())
    assert deltas[0] == {"content": "Hi."}
    first = deltas[1]["tool_calls"][0]
    assert first == {
        "index": 0,
        "id": parser.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    pieces = [d["tool_calls"][0] for d in deltas[2:]]
    assert all(set(p) == {"index", "function"} and p["index"] == 0 for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == parser.calls[0].arguments
    assert len(pieces) == 2  # one per feed that carried arguments (pieces of one feed join)


def test_parser_is_picked_by_the_chat_template():
    assert detect_parser(CHAT_TEMPLATE) == "hermes"
    assert detect_parser("<|start_header_id|>{{ m.role }}<|end_header_id|>") == "llama3"
    assert detect_parser(None) == "hermes"
    assert isinstance(make_parser("llama3", 1), Llama3Parser)
    with pytest.raises(ValueError, match="tool_call_parser"):
        make_parser("mistral")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def constrained(plan):
    state = SimpleNamespace(state=SimpleNamespace())
    return plan.constrain(SamplingParams(max_tokens=8), state).structured_outputs.json, state


def test_tool_choice_modes_and_their_constraints():
    assert tool_plan(request(), "hermes") is None
    assert tool_plan(request(tools=TOOLS, tool_choice="none"), "hermes") is None
    auto = tool_plan(request(tools=TOOLS), "llama3")
    assert auto.mode == "auto" and isinstance(auto.new_parser(), Llama3Parser)
    assert auto.constrain(SamplingParams(), None).structured_outputs is None
    named = tool_plan(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "hermes",
    )
    schema, state = constrained(named)
    assert schema == {"type": "object", **TOOLS[0]["function"]["parameters"]}
    assert state.state.param_names == {"structured_outputs.json": "tools"}
    assert constrained(
        tool_plan(
            request(
                tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
            ),
            "hermes",
        )
    )[0] == {"type": "object"}
    array, _ = constrained(tool_plan(request(tools=TOOLS, tool_choice="required"), "hermes"))
    assert array["type"] == "array" and array["minItems"] == 1
    names = [s["properties"]["name"]["enum"] for s in array["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    one, _ = constrained(
        tool_plan(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "hermes")
    )
    assert one == {"anyOf": array["items"]["anyOf"]}


def test_finish_reason_says_tool_calls_unless_a_function_was_named():
    auto = tool_plan(request(tools=TOOLS), "hermes")
    assert auto.finish_reason("stop", True) == "tool_calls"
    assert auto.finish_reason("stop", False) == "stop"
    assert auto.finish_reason("length", True) == "length"
    named = tool_plan(
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        "hermes",
    )
    assert named.finish_reason("stop", True) == "stop"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools",
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools",
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOLS[0], {"type": "retrieval"}]}, "tools", "tools[1].type"),
    ],
)
def test_bad_tools_and_tool_choice_name_the_field(fields, param, words):
    with pytest.raises(APIError) as e:
        tool_plan(request(**fields), "hermes")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_tool_call_parser_setting_travels_from_the_cli():
    import argparse

    from raylane.config import ClusterConfig
    from raylane.serve_cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert (
        config_from_args(parser.parse_args(["--tool-call-parser", "llama3"])).tool_call_parser
        == "llama3"
    )
    assert config_from_args(parser.parse_args([])).tool_call_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        ClusterConfig(tool_call_parser="mistral")
