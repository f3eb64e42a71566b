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

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3")
# the start of a call object up to its arguments value: '{"name": "f", "arguments": '
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"'
                     r'\s*:\s*(?=\S)')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    index: int
    text: str


Event = Content | CallStart | ArgsPiece


def detect_parser(chat_template: object) -> str:
    """The tool-call format a chat template teaches its model (hermes when it says nothing)."""
    text = str(chat_template or "")
    if "<tool_call>" not in text and ("<|python_tag|>" in text or "<|start_header_id|>" in text):
        return "llama3"
    return "hermes"


def make_parser(name: str, limit: int | None = None) -> ToolParser:
    """A fresh parser for one output in format `name`; at most `limit` calls come out."""
    kinds = {"hermes": HermesParser, "llama3": Llama3Parser}
    if name not in kinds:
        raise ValueError(f"tool_call_parser must be one of {list(kinds)}, got {name!r}")
    return kinds[name](limit)


class _ValueScan:
    """Where one JSON value that starts at `pos` ends, in text that grows (nesting and strings
    only; no validation). `end` is the index just past it, once seen."""

    def __init__(self, pos: int):
        self.pos = pos
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = self.pos + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:  # < 0: a bare scalar ended at its container's bracket
                    self.end = self.pos + 1 + min(self.depth, 0)
            elif self.depth == 0 and (ch == "," or ch.isspace()):
                self.end = self.pos  # a bare scalar (number, true, ...) ended
            self.pos += 1
        return self.end


class _Body:
    """One call object `{"name": ..., "arguments": ...}` as it arrives."""

    def __init__(self):
        self.text = ""
        self.scan = _ValueScan(0)
        self.name: str | None = None
        self.args: _ValueScan | None = None  # set once the header up to the arguments is read
        self.args_start = 0

    def add(self, text: str) -> str:
        """Take characters until the object closes; returns what is left over."""
        self.text += text
        end = self.scan.scan(self.text)
        rest = ""
        if end is not None:
            self.text, rest = self.text[:end], self.text[end:]
        if self.args is None and (m := _HEADER.match(self.text)):
            try:
                self.name = json.loads(m.group(1))
                self.args, self.args_start = _ValueScan(m.end()), m.end()
            except ValueError:  # a bad escape in the name: wait for the whole object
                pass
        if self.args is not None:
            self.args.scan(self.text)
        return rest

    @property
    def complete(self) -> bool:
        return self.scan.end is not None

    def args_text(self) -> str:
        end = self.args.end if self.args is not None else None
        return self.text[self.args_start:end] if self.args is not None else ""

    def call(self) -> tuple[str, str] | None:
        """(name, arguments JSON) of the complete object, or None when it is no call."""
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        key = next((k for k in ("arguments", "parameters") if k in obj), None)
        if key is None:
            return None
        if self.args is not None and self.args.end is not None and obj["name"] == self.name:
            return self.name, self.args_text()
        return obj["name"], json.dumps(obj[key], ensure_ascii=False)


class _Content:
    """Text outside calls. Whitespace right before or after a call is dropped, so trailing
    whitespace waits until it is known whether a call follows."""

    def __init__(self):
        self.pending = ""
        self.strip_lead = False

    def add(self, text: str) -> str:
        if self.strip_lead:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_lead = False
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return kept


class ToolParser:
    """Reads one output; see the module docstring. Subclasses implement `_step`: one decision on
    `self.buf`, True when it made progress, False when it must wait for more text."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.broken = False  # a call was malformed: `parse` gives the text back
        self.content = _Content()
        self.body: _Body | None = None
        self.raw = ""  # the current call's text so far, given back as content if it is no call
        self.started = False  # the current call's CallStart went out
        self.sent = 0  # argument characters of the current call that went out
        self._out: list[Event] = []

    @property
    def called(self) -> bool:
        return bool(self.calls[:self.limit])

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[Event]:
        if self.body is not None and self.started:  # cut off inside a call
            self.broken = True
            self._end_call(self.body.name or "", self.body.args_text())
        elif self.body is not None or self.raw:
            self._give_back()
        self._text(self.buf)
        self.buf = ""
        self._emit(Content(self.content.pending))
        self.content.pending = ""
        return self._take()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: the text itself when it holds no well-formed
        call, else the text around the calls (None when empty) and at most `limit` calls."""
        events = self.feed(text) + self.finish()
        if self.broken or not self.called:
            return text, []
        content = "".join(e.text for e in events if isinstance(e, Content))
        return content or None, self.calls[:self.limit]

    def _step(self) -> bool:
        raise NotImplementedError

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _emit(self, event: Event) -> None:
        index = getattr(event, "index", None)
        if (getattr(event, "text", None) == "" or
                (index is not None and self.limit is not None and index >= self.limit)):
            return
        self._out.append(event)

    def _text(self, text: str) -> None:
        self._emit(Content(self.content.add(text)))

    def _open(self, raw: str) -> None:
        """A call object starts at `self.buf[0]` after `raw` (its opening tag, whitespace)."""
        self.raw, self.body = self.raw + raw, _Body()

    def _read_body(self, after: str) -> bool:
        """Feed the buffer into the call object; at its end, settle the call and go to `after`."""
        body = self.body
        rest = body.add(self.buf)
        self.raw += self.buf[:len(self.buf) - len(rest)]
        self.buf = rest
        if body.args is not None and not self.started:
            self._start(body.name)
        if self.started:
            self._args(body.args_text())
        if not body.complete:
            return False
        call = body.call()
        if call is None and not self.started:
            self._give_back()
            return True
        if call is None:
            self.broken = True
            call = (body.name, body.args_text())
        self._end_call(*call)
        self.state = after
        return True

    def _start(self, name: str) -> None:
        self.started = True
        self.content.pending = ""  # the whitespace before a call is dropped
        self.calls.append(ToolCall(name, ""))
        self._emit(CallStart(len(self.calls) - 1, self.calls[-1].id, name))

    def _args(self, so_far: str) -> None:
        self._emit(ArgsPiece(len(self.calls) - 1, so_far[self.sent:]))
        self.sent = len(so_far)

    def _end_call(self, name: str, arguments: str) -> None:
        if not self.started:
            self._start(name)
        self._args(arguments)
        self.calls[-1].arguments = arguments
        self.body, self.raw, self.started, self.sent = None, "", False, 0
        self.content.strip_lead = True

    def _give_back(self) -> None:
        """The current call was no call: its text is content."""
        raw = self.raw + (self.body.text if self.body is not None else "")
        self.body, self.raw = None, ""
        self.state = "text"
        self._text(raw)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1)
                 if text.endswith(tag[:k])), 0)


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self.state = "text"

    def _step(self) -> bool:
        if self.state == "text":
            return self._in_text()
        if self.state == "body":
            return self._read_body("close")
        stripped = self.buf.lstrip()
        if self.state == "open":  # after <tool_call>: a call object must follow
            if not stripped:
                return False
            self._open(self.buf[:len(self.buf) - len(stripped)])
            self.buf = stripped
            if stripped[0] != "{":
                self._give_back()
            else:
                self.state = "body"
            return True
        # "close": after a call object, its </tool_call> (or, without it, plain text)
        self.buf = stripped
        if stripped.startswith(self.CLOSE):
            self.buf, self.state = stripped[len(self.CLOSE):], "text"
            return True
        if self.CLOSE.startswith(stripped):
            return False
        self.state = "text"
        return True

    def _in_text(self) -> bool:
        at = self.buf.find(self.OPEN)
        if at < 0:
            keep = len(self.buf) - _partial_suffix(self.buf, self.OPEN)
            self._text(self.buf[:keep])
            self.buf = self.buf[keep:]
            return False
        self._text(self.buf[:at])
        self.raw, self.buf, self.state = self.OPEN, self.buf[at + len(self.OPEN):], "open"
        return True


class JsonCallsParser(ToolParser):
    """Call objects joined by `sep`, after an optional `tag`, closed by an optional `end`; any
    other text ends the calls and is content."""

    tag, sep, end = "[", ",", "]"

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self.state = "start"

    def _step(self) -> bool:
        if self.state == "text":
            self._text(self.buf)
            self.buf = ""
            return False
        if self.state == "body":
            return self._read_body("sep")
        stripped = self.buf.lstrip()
        if not stripped or (self.state == "start" and stripped != self.tag
                            and self.tag.startswith(stripped)):
            return False
        skipped = self.buf[:len(self.buf) - len(stripped)]
        if self.state == "start" and stripped.startswith(self.tag):
            self.raw, self.buf = self.raw + skipped + self.tag, stripped[len(self.tag):]
            self.state = "next"
            return True
        if self.state in ("start", "next"):
            if stripped[0] == "{":
                self._open(skipped)
                self.buf, self.state = stripped, "body"
            else:
                self._give_back()  # the whitespace and tag so far, then the rest as text
            return True
        # "sep": after a call object
        self.buf, self.state = stripped, "text"
        if stripped[0] == self.sep:
            self.buf, self.state = stripped[1:], "next"
        elif self.end and stripped[0] == self.end:
            self.buf = stripped[1:]
        return True


class Llama3Parser(JsonCallsParser):
    tag, sep, end = "<|python_tag|>", ";", ""


class NamedParser(ToolParser):
    """The output is the arguments of `name`, the function the request named."""

    def __init__(self, name: str):
        super().__init__(1)
        self.name = name
        self.text = ""

    def feed(self, text: str) -> list[Event]:
        if not self.started:
            self._start(self.name)
        self.text += text
        self._args(self.text)
        return self._take()

    def finish(self) -> list[Event]:
        self.feed("")
        self.calls[-1].arguments = self.text
        return self._take()
