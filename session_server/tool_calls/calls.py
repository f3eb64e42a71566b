"""A tool call and the events a parser emits while it reads one."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


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


def openai_deltas(events: list[Event]) -> list[dict]:
    """Stream `delta`s of a chat choice, OpenAI's way: content, then each call's first entry
    (id, type, name, empty arguments), then its arguments in pieces."""
    deltas: list[dict] = []
    for e in events:
        last = deltas[-1] if deltas else {}
        if isinstance(e, Content):
            if "content" in last:
                last["content"] += e.text
            else:
                deltas.append({"content": e.text})
        elif isinstance(e, CallStart):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": e.index,
                            "id": e.id,
                            "type": "function",
                            "function": {"name": e.name, "arguments": ""},
                        }
                    ]
                }
            )
        else:  # arguments join the previous piece of the same call, not its first entry
            entry = last.get("tool_calls", [{}])[0]
            if entry.get("index") == e.index and "id" not in entry:
                entry["function"]["arguments"] += e.text
            else:
                deltas.append(
                    {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
                )
    return deltas
