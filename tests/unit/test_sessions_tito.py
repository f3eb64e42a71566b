"""Token splicing against the chat templates' own rendering of the whole conversation."""

from __future__ import annotations

import pytest
from raylane.router.errors import BadRole
from raylane.router.tito import TemplateSplicer

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import rendered

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tiny():
    return make_tokenizer()


@pytest.fixture(scope="module")
def smollm2():
    try:
        from raylane.models import default_model_path

        path = default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request):
    return request.getfixturevalue(request.param)


def reply(tok, text: str, eos: bool = True) -> list[int]:
    # canonical ids (what the tokenizer would produce), ending on end-of-turn when eos
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


FIRST = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]
FOLLOW_UPS = {
    "user": [{"role": "user", "content": "And of Germany?"}],
    "tool": [{"role": "tool", "content": '{"city": "Berlin", "temp": 21}'}],
    "two tools": [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
    "injected assistant": [
        {"role": "user", "content": "Numbers?"},
        {"role": "assistant", "content": "0 1 2"},
        {"role": "user", "content": "More."},
    ],
}


def test_first_turn_is_the_template_rendering(tok):
    splicer = TemplateSplicer(tok)
    assert splicer.first_turn(FIRST) == rendered(tok, FIRST)
    user_only = FIRST[1:]  # SmolLM2 injects its default system prompt here
    assert splicer.first_turn(user_only) == rendered(tok, user_only)


def test_first_turn_with_tools(tiny):
    assert TemplateSplicer(tiny).first_turn(FIRST, TOOLS) == rendered(tiny, FIRST, tools=TOOLS)


@pytest.mark.parametrize("name", list(FOLLOW_UPS))
@pytest.mark.parametrize("eos", [True, False], ids=["stopped", "cut by max_tokens"])
def test_next_turn_extends_to_the_whole_conversation_rendering(tok, name, eos):
    splicer = TemplateSplicer(tok)
    answer = "The capital of France is Paris."
    stored = splicer.first_turn(FIRST) + reply(tok, answer, eos)
    new = FOLLOW_UPS[name]
    appended = splicer.next_turn(new, reply(tok, answer, eos))
    conversation = FIRST + [{"role": "assistant", "content": answer}] + new
    # a turn cut by max_tokens gets the template's end-of-turn, so both cases agree
    assert stored + appended == rendered(tok, conversation)


def test_three_turns_with_tools_equal_one_rendering(tiny):
    splicer = TemplateSplicer(tiny)
    conversation = list(FIRST)
    ids = splicer.first_turn(conversation, TOOLS)
    for i, new in enumerate(FOLLOW_UPS.values()):
        answer = f"Answer number {i}."
        out = reply(tiny, answer)
        ids += out
        ids += splicer.next_turn(new, out, TOOLS)
        conversation += [{"role": "assistant", "content": answer}] + new
    assert ids == rendered(tiny, conversation, tools=TOOLS)


def test_mid_conversation_system_where_the_template_renders_it(smollm2):
    splicer = TemplateSplicer(smollm2)
    out = reply(smollm2, "Paris.")
    new = [{"role": "system", "content": "Now answer in German."}]
    conversation = FIRST + [{"role": "assistant", "content": "Paris."}] + new
    assert splicer.first_turn(FIRST) + out + splicer.next_turn(new, out) == rendered(
        smollm2, conversation
    )


def test_system_the_template_would_drop_is_refused(tiny):
    # the tiny ChatML template renders only a leading system message
    with pytest.raises(BadRole, match="system"):
        TemplateSplicer(tiny).next_turn([{"role": "system", "content": "Be terse."}], [2])


def test_template_errors_become_bad_role():
    tok = make_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    with pytest.raises(BadRole, match="no tools here"):
        TemplateSplicer(tok).next_turn([{"role": "tool", "content": "1"}], [2])
