"""`ToolParser`: the incremental reading every format shares (content, call objects, limits)."""

from __future__ import annotations

from raylane.session_server.tool_calls.body import CallBody
from raylane.session_server.tool_calls.calls import ArgsPiece, CallStart, Content, Event, ToolCall


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
        self.pending = text[len(kept) :]
        return kept


class ToolParser:
    """Reads one output; see the package docstring. Subclasses implement `_step`: one decision on
    `self.buf`, True when it made progress, False when it must wait for more text."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.state = "text"
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.broken = False  # a call was malformed: `parse` gives the text back
        self.content = _Content()
        self.body: CallBody | None = None
        self.raw = ""  # the current call's text so far, given back as content if it is no call
        self.started = False  # the current call's CallStart went out
        self.sent = 0  # argument characters of the current call that went out
        self._out: list[Event] = []

    @property
    def called(self) -> bool:
        return bool(self.calls[: self.limit])

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
        return content or None, self.calls[: self.limit]

    def _step(self) -> bool:
        raise NotImplementedError

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _emit(self, event: Event) -> None:
        index = getattr(event, "index", None)
        if getattr(event, "text", None) == "" or (
            index is not None and self.limit is not None and index >= self.limit
        ):
            return
        self._out.append(event)

    def _text(self, text: str) -> None:
        self._emit(Content(self.content.add(text)))

    def _open(self, raw: str) -> None:
        """A call object starts at `self.buf[0]` after `raw` (its opening tag, whitespace)."""
        self.raw, self.body = self.raw + raw, CallBody()

    def _read_body(self, after: str) -> bool:
        """Feed the buffer into the call object; at its end, settle the call and go to `after`."""
        body = self.body
        if body is None:  # only the states after `_open` read a body
            raise RuntimeError(f"no call object to read in state {self.state!r}")
        rest = body.add(self.buf)
        self.raw += self.buf[: len(self.buf) - len(rest)]
        self.buf = rest
        if body.args is not None and not self.started:
            self._start(body.name or "")
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
            call = (body.name or "", body.args_text())
        self._end_call(*call)
        self.state = after
        return True

    def _start(self, name: str) -> None:
        self.started = True
        self.content.pending = ""  # the whitespace before a call is dropped
        self.calls.append(ToolCall(name, ""))
        self._emit(CallStart(len(self.calls) - 1, self.calls[-1].id, name))

    def _args(self, so_far: str) -> None:
        self._emit(ArgsPiece(len(self.calls) - 1, so_far[self.sent :]))
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
