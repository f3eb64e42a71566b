"""The consolidation prompt and the validation of the model's answer.

Request: the last user message holds exactly one JSON object
`{"memories": [{"id", "text", "tags"}], "observations": [{"id", "text"}]}`.
Answer: one JSON object keyed by every memory id of the batch, each an action for that memory:
`{"<id>": {"action": "create", "text"} | {"action": "update", "observation_id", "text"} |
{"action": "skip"}}`. `answer_format` turns a batch into the JSON schema of exactly that (every
id required, observation ids an enum of the scope's, text bounded), sent as a `json_schema`
response format: an endpoint with constrained decoding can only produce a valid answer.
The older `{"actions": [...]}` answer (a list of actions over several memories) is read too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .errors import InvalidAnswer
from .records import Action, Memory, ObservationView

JSON_RESPONSE_FORMAT = {"type": "json_object"}
MAX_TEXT_CHARS = 240  # an observation's text in a constrained answer

SYSTEM_PROMPT = """\
You consolidate an agent's memories into durable observations.
You get new memories and the existing observations of the same scope. Answer with one JSON
object keyed by every memory id, and nothing else. Each value is one of:
  {"action": "create", "text": "..."}  a new observation from this memory (memories given the
      same text become one observation)
  {"action": "update", "observation_id": "...", "text": "..."}  rewrite an existing
      observation so it also reflects this memory
  {"action": "skip"}  a memory with nothing worth keeping
Prefer updating an observation over creating a near-duplicate. Use only the ids you were given."""


def answer_format(memory_ids: Sequence[int], observation_ids: Sequence[int]) -> dict[str, Any]:
    """The `json_schema` response format of a valid answer for this batch and scope."""
    text = {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS, "pattern": r"^\S"}
    choices: list[dict[str, Any]] = [
        _action_schema("skip", {}),
        _action_schema("create", {"text": text}),
    ]
    if observation_ids:
        choices.append(
            _action_schema(
                "update",
                {"observation_id": {"enum": [str(i) for i in observation_ids]}, "text": text},
            )
        )
    ids = [str(i) for i in memory_ids]
    schema = {
        "type": "object",
        "properties": {i: {"anyOf": choices} for i in ids},
        "required": ids,
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": "consolidation", "schema": schema, "strict": True},
    }


def _action_schema(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"action": {"const": kind}, **fields},
        "required": ["action", *fields],
        "additionalProperties": False,
    }


USER_LEAD = "Consolidate these memories:\n"


def build_messages(
    memories: Sequence[Memory], observations: Sequence[ObservationView]
) -> list[dict[str, str]]:
    payload = {
        "memories": [{"id": str(m.id), "text": m.content, "tags": list(m.tags)} for m in memories],
        "observations": [{"id": str(o.id), "text": o.text} for o in observations],
    }
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_LEAD + json.dumps(payload, ensure_ascii=False)},
    ]


def read_request(messages: Sequence[dict[str, str]]) -> dict[str, Any]:
    """The JSON object of the last user message (what a model, or a fake one, reads)."""
    user = [m["content"] for m in messages if m.get("role") == "user"]
    if not user:
        raise ValueError("the messages have no user message")
    text = user[-1]
    start = text.find("{")
    if start < 0:
        raise ValueError("the last user message holds no JSON object")
    obj, end = json.JSONDecoder().raw_decode(text, start)
    if "{" in text[end:]:
        raise ValueError("the last user message holds more than one JSON object")
    return obj


def parse_answer(
    text: str, memory_ids: Sequence[int], observation_ids: Sequence[int]
) -> list[Action]:
    """Validate a model answer against its batch and scope; raises InvalidAnswer."""
    obj = _load_json(text)
    if not isinstance(obj, dict):
        raise InvalidAnswer("the answer is not a JSON object")
    raw_actions = obj.get("actions") if "actions" in obj else _from_keyed(obj)
    if not isinstance(raw_actions, list):
        raise InvalidAnswer('the answer is not an object with an "actions" list')
    memories = {str(i): i for i in memory_ids}
    scope = {str(i): i for i in observation_ids}
    actions = [_action(raw, memories, scope) for raw in raw_actions]
    _check_accounting(actions, memory_ids)
    return actions


def _from_keyed(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A keyed answer as actions: skips in one, updates by observation, creates by text."""
    groups: dict[tuple, dict[str, Any]] = {}
    for memory_id, value in obj.items():
        if not isinstance(value, dict):
            raise InvalidAnswer(f"memory {memory_id}: not an action object")
        kind = value.get("action")
        key = (
            kind,
            value.get("observation_id") if kind == "update" else None,
            value.get("text") if kind == "create" else None,
        )
        group = groups.setdefault(key, {**value, "memory_ids": []})
        group["memory_ids"].append(memory_id)
        if kind == "update" and value.get("text") not in group["text"]:
            group["text"] = f"{group['text']}; {value.get('text')}"
    return list(groups.values())


def _load_json(text: str) -> Any:
    body = text.strip()
    # Chat models often fence JSON in markdown even when asked not to; the fence is not content.
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise InvalidAnswer(f"the answer is not valid JSON: {exc}") from None


def _action(raw: Any, memories: dict[str, int], scope: dict[str, int]) -> Action:
    if not isinstance(raw, dict) or raw.get("action") not in ("create", "update", "skip"):
        raise InvalidAnswer(f"not a create/update/skip action: {raw!r}")
    kind = raw["action"]
    ids = raw.get("memory_ids")
    if not isinstance(ids, list) or not ids:
        raise InvalidAnswer(f"{kind} action without memory_ids")
    unknown = [i for i in ids if str(i) not in memories]
    if unknown:
        raise InvalidAnswer(f"{kind} action names memories outside the batch: {unknown}")
    memory_ids = tuple(dict.fromkeys(memories[str(i)] for i in ids))
    if kind == "skip":
        return Action("skip", memory_ids)
    text = raw.get("text")
    if not isinstance(text, str) or not text.strip():
        raise InvalidAnswer(f"{kind} action without text")
    if kind == "create":
        return Action("create", memory_ids, text=text.strip())
    observation = str(raw.get("observation_id"))
    if observation not in scope:
        raise InvalidAnswer(f"update names an observation outside the scope: {observation}")
    return Action("update", memory_ids, text=text.strip(), observation_id=scope[observation])


def _check_accounting(actions: list[Action], memory_ids: Sequence[int]) -> None:
    used = {i for a in actions for i in a.memory_ids}
    missing = [i for i in memory_ids if i not in used]
    if missing:
        raise InvalidAnswer(f"the answer leaves memories unaccounted for: {missing}")
    skipped = {i for a in actions if a.kind == "skip" for i in a.memory_ids}
    kept = {i for a in actions if a.kind != "skip" for i in a.memory_ids}
    if skipped & kept:
        raise InvalidAnswer(f"memories both skipped and kept: {sorted(skipped & kept)}")
    updated = [a.observation_id for a in actions if a.kind == "update"]
    if len(updated) != len(set(updated)):
        raise InvalidAnswer("the answer updates the same observation twice")
