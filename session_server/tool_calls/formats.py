"""The formats: Hermes/Qwen tags, Llama 3 JSON, the JSON of a required call, a named call."""

from __future__ import annotations

from raylane.session_server.tool_calls.calls import Event
from raylane.session_server.tool_calls.parser import ToolParser

PARSERS = ("hermes", "llama3")


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


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    return next(
        (k for k in range(min(len(text), len(tag) - 1), 0, -1) if text.endswith(tag[:k])), 0
    )


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _step(self) -> bool:
        if self.state == "text":
            return self._in_text()
        if self.state == "body":
            return self._read_body("close")
        stripped = self.buf.lstrip()
        if self.state == "open":  # after <tool_call>: a call object must follow
            if not stripped:
                return False
            self._open(self.buf[: len(self.buf) - len(stripped)])
            self.buf = stripped
            if stripped[0] != "{":
                self._give_back()
            else:
                self.state = "body"
            return True
        # "close": after a call object, its </tool_call> (or, without it, plain text)
        self.buf = stripped
        if stripped.startswith(self.CLOSE):
            self.buf, self.state = stripped[len(self.CLOSE) :], "text"
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
        self.raw, self.buf, self.state = self.OPEN, self.buf[at + len(self.OPEN) :], "open"
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
        if not stripped or (
            self.state == "start" and stripped != self.tag and self.tag.startswith(stripped)
        ):
            return False
        skipped = self.buf[: len(self.buf) - len(stripped)]
        if self.state == "start" and stripped.startswith(self.tag):
            self.raw, self.buf = self.raw + skipped + self.tag, stripped[len(self.tag) :]
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
