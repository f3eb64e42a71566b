"""A chat request's `tools` and `tool_choice`, checked (400 naming the field) and turned into what
the request needs: the structured output that forces a call, and the parser that reads calls
back out of the generated text.

tool_choice "none": plain text (the template still sees the tools); "auto" (the default when
there are tools): the model's own format, parsed; "required": at least one call, its arguments
constrained by the tools' schemas; {"type": "function", "function": {"name": ...}}: a call of
that function, the output constrained to its arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from raylane.actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from raylane.session_server.errors import bad_request
from raylane.session_server.schemas import ChatCompletionRequest
from raylane.session_server.tool_calls import JsonCallsParser, NamedParser, ToolParser, make_parser

_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    functions: dict[str, dict]  # name -> the tool's "function" object
    parser: str  # the model's format, for "auto"
    parallel: bool  # False: at most one call comes back
    named: str | None = None

    @property
    def limit(self) -> int | None:
        return None if self.parallel else 1

    def new_parser(self) -> ToolParser:
        """A parser for one output (one choice)."""
        if self.named is not None:  # mode "named"
            return NamedParser(self.named)
        if self.mode == "required":
            return JsonCallsParser(self.limit)
        return make_parser(self.parser, self.limit)

    def constrain(self, params: SamplingParams, request: Request) -> SamplingParams:
        """`params` with the structured output that forces the call(s), if the mode has one;
        the engine's errors about it then name `tools` (see errors.install_error_handlers)."""
        if self.mode == "auto":
            return params
        if params.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {self.mode!r} constrains the output itself and cannot "
                f"be combined with response_format or structured_outputs",
                "tool_choice",
            )
        request.state.param_names = {"structured_outputs.json": "tools"}
        if self.named is not None:  # mode "named"
            schema = _arguments_schema(self.functions[self.named])
        else:
            calls = [_call_schema(name, fn) for name, fn in self.functions.items()]
            schema = (
                {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
                if self.parallel
                else {"anyOf": calls}
            )
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" when the model stopped after calling tools (a named choice says "stop",
        as OpenAI and vLLM do)."""
        return "tool_calls" if called and reason == "stop" and self.mode != "named" else reason


def tool_plan(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """The request's plan, or None when no tool calls are to be read (no tools, or "none")."""
    functions = _functions(body.tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if isinstance(choice, str) and choice not in _CHOICES:
        raise bad_request(
            f"tool_choice must be one of {list(_CHOICES)} or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
            "tool_choice",
        )
    if not functions:
        raise bad_request(
            f"tool_choice {_show(choice)} needs tools; give tools or use 'none'", "tool_choice"
        )
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(choice, functions, parser, parallel)
    return ToolPlan("named", functions, parser, parallel, _named(choice, functions))


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    functions = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.function.name is required (a non-empty string)", "tools")
        params = fn.get("parameters")
        if params is not None and (
            not isinstance(params, dict) or params.get("type", "object") != "object"
        ):
            raise bad_request(
                f"{where}.function.parameters must be a JSON schema of type "
                f"'object' (function {name!r})",
                "tools",
            )
        functions[name] = fn
    return functions


def _named(choice: Any, functions: dict[str, dict]) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "tool_choice must be {'type': 'function', 'function': {'name': ...}} "
            "or one of " + str(list(_CHOICES)),
            "tool_choice",
        )
    if name not in functions:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not in tools ({sorted(functions)})",
            "tool_choice",
        )
    return name


def _arguments_schema(fn: dict) -> dict:
    return {"type": "object", **(fn.get("parameters") or {})}


def _call_schema(name: str, fn: dict) -> dict:
    # "name" first: the parser streams the arguments once it has read the name
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "arguments": _arguments_schema(fn),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "'function'"
