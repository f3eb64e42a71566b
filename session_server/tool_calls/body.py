"""Reading one call object `{"name": ..., "arguments": ...}` as its text arrives."""

from __future__ import annotations

import json
import re

# the start of a call object up to its arguments value: '{"name": "f", "arguments": '
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"'
    r"\s*:\s*(?=\S)"
)


class ValueScan:
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


class CallBody:
    """One call object `{"name": ..., "arguments": ...}` as it arrives."""

    def __init__(self):
        self.text = ""
        self.scan = ValueScan(0)
        self.name: str | None = None
        self.args: ValueScan | None = None  # set once the header up to the arguments is read
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
                self.args, self.args_start = ValueScan(m.end()), m.end()
            except ValueError:  # a bad escape in the name: wait for the whole object
                pass
        if self.args is not None:
            self.args.scan(self.text)
        return rest

    @property
    def complete(self) -> bool:
        return self.scan.end is not None

    def args_text(self) -> str:
        """The arguments read so far (all of them once the value ended)."""
        return self.text[self.args_start : self.args.end] if self.args is not None else ""

    def call(self) -> tuple[str, str] | None:
        """(name, arguments JSON) of the complete object, or None when it is no call."""
        try:
            obj = json.loads(self.text)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than json reads
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        key = next((k for k in ("arguments", "parameters") if k in obj), None)
        if key is None:
            return None
        if self.name is not None and self.args is not None and self.args.end is not None:
            return self.name, self.args_text()  # as streamed
        return obj["name"], json.dumps(obj[key], ensure_ascii=False)
