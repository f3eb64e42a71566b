"""Tool calls in generated text: parsers that turn a model's output into OpenAI `tool_calls`.

A parser reads one output incrementally: `feed(text)` takes the next piece and returns the events
it settles (content text, a call's start, a piece of its arguments), `finish()` the rest. No
decision depends on where the pieces were cut, so streamed events add up to what `parse(text)`
returns for the whole output. Formats:

- hermes (Qwen, Hermes, ...): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several in a row for parallel calls; the text around them is the message content;
- llama3 (Llama 3.x JSON): the output is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several joined by `;`;
- json: what `tool_choice="required"` generates, a JSON array of `{"name", "arguments"}` objects
  (or one object when parallel calls are off);
- named: what a named `tool_choice` generates, the arguments object itself.

Arguments are the JSON text the model wrote, sliced from the output as is, so streamed pieces
and the final message agree byte for byte. A call whose JSON turns out malformed leaves the whole
output as text in `parse`; a stream cannot take back a call it started (hazard: a truncated or
broken call stays a call there, with the arguments generated so far).
"""

from __future__ import annotations

from raylane.session_server.tool_calls.calls import (
    ArgsPiece,
    CallStart,
    Content,
    Event,
    ToolCall,
    openai_deltas,
)
from raylane.session_server.tool_calls.formats import (
    PARSERS,
    HermesParser,
    JsonCallsParser,
    Llama3Parser,
    NamedParser,
    detect_parser,
    make_parser,
)
from raylane.session_server.tool_calls.parser import ToolParser

__all__ = [
    "PARSERS",
    "ArgsPiece",
    "CallStart",
    "Content",
    "Event",
    "HermesParser",
    "JsonCallsParser",
    "Llama3Parser",
    "NamedParser",
    "ToolCall",
    "ToolParser",
    "detect_parser",
    "make_parser",
    "openai_deltas",
]
