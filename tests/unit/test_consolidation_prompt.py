"""The consolidation prompt, answer validation, grouping and config: pure logic."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from raylane.actors.consolidation import ConsolidationConfig, InvalidAnswer
from raylane.actors.consolidation.grouping import chunked, group_by_tags
from raylane.actors.consolidation.prompt import (
    answer_format,
    build_messages,
    parse_answer,
    read_request,
)
from raylane.actors.consolidation.records import Action, Memory, ObservationView, normalize_tags

from tests.support.fake_llm import default_answer

NOW = datetime(2025, 1, 1, tzinfo=timezone.utc)


def memory(i: int, tags: tuple[str, ...] = ("t",), text: str = "") -> Memory:
    return Memory(id=i, bank_id="b", content=text or f"fact {i}", tags=tags, created_at=NOW)


def answer(*actions: dict) -> str:
    return json.dumps({"actions": list(actions)})


def test_last_user_message_holds_exactly_one_json_object() -> None:
    messages = build_messages(
        [memory(1), memory(2, text='braces {"x": 1}')], [ObservationView(9, "obs")]
    )
    assert messages[-1]["role"] == "user"
    request = read_request(messages)
    assert request == {
        "memories": [
            {"id": "1", "text": "fact 1", "tags": ["t"]},
            {"id": "2", "text": 'braces {"x": 1}', "tags": ["t"]},
        ],
        "observations": [{"id": "9", "text": "obs"}],
    }
    with pytest.raises(ValueError, match="more than one"):
        read_request([{"role": "user", "content": "{} {}"}])


def test_valid_answer_becomes_actions() -> None:
    text = answer(
        {"action": "create", "memory_ids": ["1"], "text": " new "},
        {"action": "update", "observation_id": 9, "memory_ids": [2, "3"], "text": "u"},
        {"action": "skip", "memory_ids": ["4"]},
    )
    assert parse_answer(text, [1, 2, 3, 4], [9]) == [
        Action("create", (1,), text="new"),
        Action("update", (2, 3), text="u", observation_id=9),
        Action("skip", (4,)),
    ]


def test_markdown_fenced_json_is_accepted() -> None:
    text = "```json\n" + answer({"action": "skip", "memory_ids": ["1"]}) + "\n```"
    assert parse_answer(text, [1], []) == [Action("skip", (1,))]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("not json", "not valid JSON"),
        ('["actions"]', "not a JSON object"),
        ('{"actions": {}}', '"actions" list'),
        (answer({"action": "merge", "memory_ids": ["1"]}), "create/update/skip"),
        (answer({"action": "create", "memory_ids": ["1", "7"], "text": "x"}), "outside the batch"),
        (answer({"action": "create", "memory_ids": ["1"], "text": ""}), "without text"),
        (answer({"action": "skip", "memory_ids": []}), "without memory_ids"),
        (
            answer({"action": "update", "observation_id": "8", "memory_ids": ["1"], "text": "x"}),
            "outside the scope",
        ),
        (answer({"action": "create", "memory_ids": ["1"], "text": "x"}), "unaccounted"),
        (
            answer(
                {"action": "skip", "memory_ids": ["1", "2"]},
                {"action": "create", "memory_ids": ["2"], "text": "x"},
            ),
            "both skipped and kept",
        ),
        (
            answer(
                {"action": "update", "observation_id": "9", "memory_ids": ["1"], "text": "x"},
                {"action": "update", "observation_id": "9", "memory_ids": ["2"], "text": "y"},
            ),
            "same observation twice",
        ),
    ],
)
def test_invalid_answers_fail_the_call(text: str, reason: str) -> None:
    with pytest.raises(InvalidAnswer, match=reason):
        parse_answer(text, [1, 2], [9])


def test_fake_default_answer_is_valid() -> None:
    memories = [memory(1), memory(2, text="skip: noise")]
    for observations in ([], [ObservationView(5, "old")]):
        request = read_request(build_messages(memories, observations))
        actions = parse_answer(
            json.dumps(default_answer(request)), [1, 2], [o.id for o in observations]
        )
        assert {a.kind for a in actions} == {"skip", "update" if observations else "create"}


def test_grouping_is_by_exact_tag_set_in_order() -> None:
    ms = [memory(1, ("a",)), memory(2, ("a", "b")), memory(3, ()), memory(4, ("a",))]
    groups = group_by_tags(ms)
    assert list(groups) == [("a",), ("a", "b"), ()]
    assert [m.id for m in groups[("a",)]] == [1, 4]
    assert chunked([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert normalize_tags(["b", "a", "b"]) == ("a", "b")


@pytest.mark.parametrize("field", ["batch_size", "llm_batch_size", "max_parallel_groups"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_config_rejects_bad_sizes_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ConsolidationConfig(**{field: value})


def test_config_defaults_and_is_frozen() -> None:
    config = ConsolidationConfig()
    assert (config.batch_size, config.llm_batch_size) == (50, 8)
    with pytest.raises(AttributeError):
        config.batch_size = 3  # type: ignore[misc]


def test_a_keyed_answer_fits_its_schema_and_becomes_grouped_actions() -> None:
    import jsonschema

    schema = answer_format([1, 2, 3, 4], [9])["json_schema"]["schema"]
    keyed = {
        "1": {"action": "create", "text": "tea"},
        "2": {"action": "create", "text": "tea"},
        "3": {"action": "skip"},
        "4": {"action": "update", "observation_id": "9", "text": "dog"},
    }
    jsonschema.validate(keyed, schema)
    actions = parse_answer(json.dumps(keyed), [1, 2, 3, 4], [9])
    assert sorted(actions, key=lambda a: a.kind) == [
        Action("create", (1, 2), text="tea"),
        Action("skip", (3,)),
        Action("update", (4,), text="dog", observation_id=9),
    ]
    for broken in (
        {k: v for k, v in keyed.items() if k != "3"},  # a memory left out
        {**keyed, "4": {"action": "update", "observation_id": "8", "text": "x"}},
        {**keyed, "5": {"action": "skip"}},  # a memory outside the batch
        {**keyed, "1": {"action": "create", "text": "x" * 241}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
