"""Chat messages as the registry stores and compares them.

Clients echo earlier turns back in many shapes (the OpenAI SDK adds `refusal: None`,
`tool_calls: None`, content as a list of text parts, ...). Normalising to the keys a chat
template reads makes "the same conversation" a plain `==` and keeps those extras out of the
template.
"""

from __future__ import annotations

from typing import Any

from raylane.router.errors import BadRole, BadSessionRequest

ROLES = ("system", "user", "assistant", "tool")
# roles a new turn may open or end with: the model answers after them
FOLLOW_ROLES = ("user", "tool", "system")
_OPTIONAL_KEYS = ("name", "tool_call_id", "reasoning_content")

Message = dict[str, Any]


def normalize_messages(messages: Any) -> list[Message]:
    """Validate a request's `messages` and return them normalised (a new list of new dicts)."""
    if not isinstance(messages, list) or not messages:
        raise BadSessionRequest(
            "messages must be a non-empty list of {'role', 'content'} objects", param="messages"
        )
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def normalize_message(message: Any, index: int = 0) -> Message:
    if not isinstance(message, dict):
        raise BadSessionRequest(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if role not in ROLES:
        raise BadRole(
            f"messages[{index}].role {role!r} is not one of {list(ROLES)}", param="messages"
        )
    out: Message = {"role": role, "content": _content(message.get("content"), index)}
    for key in _OPTIONAL_KEYS:
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, index) for c in message["tool_calls"]]
    return out


def _content(content: Any, index: int) -> str:
    # None (an assistant turn that only calls tools) renders as "" in every template we know
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadSessionRequest(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadSessionRequest(
            f"messages[{index}].tool_calls must hold "
            f"{{'function': {{'name', 'arguments'}}}} objects",
            param="messages",
        )
    fn = call["function"]
    out = {
        "type": call.get("type") or "function",
        "function": {"name": fn.get("name"), "arguments": fn.get("arguments")},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def common_prefix_len(stored: list[Message], incoming: list[Message]) -> int:
    n = 0
    for a, b in zip(stored, incoming):
        if a != b:
            break
        n += 1
    return n


def check_new_roles(new: list[Message], continuing: bool) -> None:
    """A turn must end with a message the model answers; after a stored (generated) assistant
    turn it must also open with one. Assistant messages in between are client-injected text."""
    if not new:
        raise BadRole(
            "no new message after the stored conversation: the last message must be "
            f"one of {list(FOLLOW_ROLES)}",
            param="messages",
        )
    if new[-1]["role"] not in FOLLOW_ROLES:
        raise BadRole(
            f"the last message has role {new[-1]['role']!r}; it must be one of "
            f"{list(FOLLOW_ROLES)} so the model has something to answer",
            param="messages",
        )
    if continuing and new[0]["role"] not in FOLLOW_ROLES:
        raise BadRole(
            f"the first new message has role {new[0]['role']!r}; after the stored "
            f"assistant turn only {list(FOLLOW_ROLES)} may follow",
            param="messages",
        )
