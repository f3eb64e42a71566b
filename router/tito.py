"""Token in, token out: turn chat messages into prompt ids that only ever extend the stored ids.

The first turn is the chat template's rendering of its messages. A later turn never re-renders
or re-tokenizes what is stored (the model's own output ids, in particular, may not be what the
tokenizer would produce for their text); only the turn's new messages are rendered and their ids
appended.

Technique — render behind a dummy prefix and take the suffix:
    text = template([SYSTEM, USER, ASSISTANT(marker)] + new_messages, add_generation_prompt)
    ids  = encode(text after the marker)
The suffix starts with the template's end of the previous assistant turn (ChatML:
"<|im_end|>\n") and ends with the generation prompt. The junction: when the model stopped on its
end-of-turn token, the stored output already ends with the first ids of that suffix, so the
longest overlap (bounded by the length of the template's own end-of-turn) is skipped; a turn cut
by `max_tokens` or a stop string overlaps nothing and gets the template's end-of-turn appended.

Why this and not "render the whole conversation and strip the stored prefix": that costs
O(conversation) per turn, and re-rendering earlier turns is exactly what drifts — templates
rewrite history (Qwen3 drops old reasoning, SmolLM2 injects a default system prompt) and the
model's ids need not be canonical, so the stored ids are no prefix of the re-rendering. A fixed
dummy prefix costs O(new messages), opens with a system message (so templates that inject a
default one, or that only allow system first, behave) and ends on an assistant turn, which is
what every stored conversation ends on.
"""

from __future__ import annotations

from typing import Any, Protocol

from raylane.router.errors import BadRole
from raylane.router.messages import Message

# Plain words: any template renders them verbatim, and the marker cannot occur by accident.
_MARKER = "raylane-junction-4f1c9e2a"
_DUMMY: list[Message] = [
    {"role": "system", "content": "system"},
    {"role": "user", "content": "user"},
    {"role": "assistant", "content": _MARKER},
]


class ChatTokenizer(Protocol):
    """What the splicer needs of a tokenizer (a Hugging Face tokenizer fits)."""

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class TemplateSplicer:
    """Builds each turn's prompt ids from its messages with the tokenizer's chat template."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer

    def first_turn(
        self, messages: list[Message], tools: list[dict] | None = None, **template_kwargs: Any
    ) -> list[int]:
        """The whole prompt of a session's first turn (what `apply_chat_template` gives)."""
        text = self._render(messages, tools, True, template_kwargs)
        _check_system_kept(messages[1:], text)
        return self._encode(text)

    def next_turn(
        self,
        new_messages: list[Message],
        last_output_ids: list[int],
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The ids to append after a stored turn whose output was `last_output_ids`."""
        suffix = _after_marker(self._render(_DUMMY + new_messages, tools, True, template_kwargs))
        _check_system_kept(new_messages, suffix)
        ids = self._encode(suffix)
        end_of_turn = _after_marker(self._render(_DUMMY, tools, False, template_kwargs))
        skip = _overlap(last_output_ids, ids, len(self._encode(end_of_turn)))
        return ids[skip:]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as e:  # jinja's raise_exception, a TypeError on odd content, ...
            raise BadRole(f"the chat template rejected the messages: {e}", param="messages") from e

    def _encode(self, text: str) -> list[int]:
        # the template writes its own BOS where it wants one, as apply_chat_template does
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _after_marker(text: str) -> str:
    at = text.find(_MARKER)
    if at < 0 or text.find(_MARKER, at + 1) >= 0:
        raise BadRole(
            "the chat template does not render an assistant turn verbatim, so new "
            "messages cannot be appended to a stored conversation"
        )
    return text[at + len(_MARKER) :]


def _overlap(tail: list[int], head: list[int], limit: int) -> int:
    """The largest k <= limit with tail[-k:] == head[:k]."""
    for k in range(min(limit, len(tail), len(head)), 0, -1):
        if tail[-k:] == head[:k]:
            return k
    return 0


def _check_system_kept(messages: list[Message], rendered: str) -> None:
    # some templates silently drop a system message that is not the first one; refuse instead
    # of training on a prompt the client did not mean
    for m in messages:
        if m["role"] == "system" and m["content"] and m["content"] not in rendered:
            raise BadRole(
                "this model's chat template drops system messages after the first; "
                "send the instruction as a user message",
                param="messages",
            )
