"""Turning request prompts into token ids: completion prompts, chat templates, /generate inputs."""

from __future__ import annotations

import json
from typing import Any

from raylane.session_server.errors import bad_request
from raylane.session_server.schemas import ChatMessage, ChatTemplateFields


def completion_prompts(prompt: str | list, tokenizer) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [encode(tokenizer, prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [encode(tokenizer, p, "prompt") for p in prompt]
    return [_non_empty(list(p), "prompt") for p in prompt]


def generate_prompts(
    text: str | list[str] | None, input_ids: list | None, tokenizer
) -> tuple[list[list[int]], bool]:
    """SGLang's `text` or `input_ids`; returns the prompts and whether the input was a batch."""
    if (text is None) == (input_ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", "input_ids")
    if input_ids is not None:
        if input_ids and isinstance(input_ids[0], list):
            return [_non_empty(list(p), "input_ids") for p in input_ids], True
        return [_non_empty(list(input_ids), "input_ids")], False
    if isinstance(text, str):
        return [encode(tokenizer, text, "text")], False
    if not text:
        raise bad_request("text: must not be empty", "text")
    return [encode(tokenizer, t, "text") for t in text], True


def encode(tokenizer, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    return _non_empty(list(tokenizer.encode(text, add_special_tokens=add_special_tokens)), field)


def render_chat(tokenizer, body: ChatTemplateFields) -> list[int]:
    """The conversation rendered with the tokenizer's chat template, as token ids."""
    text = chat_text(tokenizer, body)
    return encode(tokenizer, text, "messages", add_special_tokens=False)


def chat_text(tokenizer, body: ChatTemplateFields) -> str:
    if body.add_generation_prompt and body.continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message are exclusive",
            "continue_final_message",
        )
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    kwargs.update(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tokenize=False,
    )
    if body.tools is not None:
        kwargs["tools"] = body.tools
    messages = message_dicts(body.messages)
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error (jinja2, missing keys) is the request's fault
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as plain dicts for the template; text content parts are joined, and tool-call
    arguments (JSON text in OpenAI's format) become objects, as templates expect (vLLM too)."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(_part_text(p.type, p.text, i) for p in m.content)
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_call_for_template(c) for c in d["tool_calls"]]
        out.append(d)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):
        return call  # not JSON (or nested too deep): the template gets the text as it came
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def _part_text(kind: str, text: str | None, i: int) -> str:
    if kind != "text" or text is None:
        raise bad_request(
            f"messages[{i}].content: only text parts are supported, got {kind!r}", "messages"
        )
    return text


def _non_empty(ids: list[int], field: str) -> list[int]:
    if not ids:
        raise bad_request(f"{field}: must not be empty", field)
    return ids
