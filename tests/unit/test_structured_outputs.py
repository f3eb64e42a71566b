"""Structured outputs against independent checks, on the tiny random-weight models (the hard
case: only the mask makes their output valid): `jsonschema` for JSON schemas, Python's `re` for
regexes and regular grammars, Hugging Face logits for the raw logprobs and for greedy choices
within a mask computed here with the `regex` module's partial matching."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import regex
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams

from tests.hf_reference import hf_greedy, hf_model

MAX_TOKENS = 200  # far more than any bounded output below needs: "length" would be a bug

SCHEMAS = {
    # free-form strings (bounded), negative integers, an optional property
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": -5, "maximum": 120},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "nick": {"type": "string", "maxLength": 4},
        },
        "required": ["name", "age", "ok", "tags"],
        "additionalProperties": False,
    },
    # nested objects, enums with null, bounded arrays of booleans
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 5},
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"enum": ["up", "down", None]},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        },
        "required": ["id", "point", "flags"],
        "additionalProperties": False,
    },
    # a top-level array of objects (given to the engine as JSON text)
    "pairs": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"enum": ["a", "b", "c"]},
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
# no free strings and no negative numbers ("-0" is valid JSON that re-dumps as "0"): the
# compact text is exactly what json.dumps writes for the parsed value
CANONICAL = {"nested", "pairs"}

REGEXES = [
    r"(cat|dog)-[0-9]{2,4}",
    r"[A-Z][a-z]{0,6}@[a-z]{2,5}\.(com|org)",
    r"(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?",
]
CHOICES = ["yes", "yes please", "no", "maybe not", "naïve"]
# (grammar, an equivalent Python regex)
GRAMMARS = {
    "lark": (
        'start: greeting " " name "!"\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]{1,5}/\n',
        r"(hi|hello) [A-Z][a-z]{1,5}!",
    ),
    "lark_repeat": (
        'start: "[" num ("," num)~0..3 "]"\nnum: /[0-9]{1,2}/\n',
        r"\[[0-9]{1,2}(,[0-9]{1,2}){0,3}\]",
    ),
    "gbnf": (
        'root ::= "(" expr ")"\nexpr ::= num (op num)?\nop ::= "+" | "*"\nnum ::= [1-9] [0-9]?\n',
        r"\(([1-9][0-9]?)([+*][1-9][0-9]?)?\)",
    ),
    "gbnf_repeat": (
        'root ::= item ("," item){0,2}\nitem ::= [a-c] [a-c]? [a-c]?\n',
        r"[a-c]{1,3}(,[a-c]{1,3}){0,2}",
    ),
}


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def sampled(
    spec: StructuredOutputsParams, seed: int | None = None, n: int = 1, **kw
) -> SamplingParams:
    """Greedy when `seed` is None, else seeded sampling at temperature 1."""
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        **{
            "temperature": temperature,
            "seed": seed,
            "n": n,
            "max_tokens": MAX_TOKENS,
            "structured_outputs": spec,
            **kw,
        }
    )


def mixed(spec: StructuredOutputsParams, **kw) -> list[SamplingParams]:
    """Greedy, then two seeded requests of three samples each."""
    return [sampled(spec, **kw), sampled(spec, 11, 3, **kw), sampled(spec, 12, 3, **kw)]


def prompt_for(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def completions(outs) -> list:
    return [c for out in outs for c in out.outputs]


def outside_strings(text: str) -> str:
    """A JSON text without its string literals."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', "", text)


def new_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=16, num_kv_blocks=128))


@pytest.fixture(scope="module")
def llama_engine(tiny_llama_dir) -> LLMEngine:
    engine = new_engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def qwen3_engine(tiny_qwen3_dir) -> LLMEngine:
    engine = new_engine(tiny_qwen3_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(params=["llama_engine", "qwen3_engine"])
def engine(request) -> LLMEngine:
    return request.getfixturevalue(request.param)


def generate(
    engine: LLMEngine, params: list[SamplingParams], seed: int = 0, length: int = 21
) -> list:
    prompts = [
        prompt_for(engine.validator.vocab_size, length + i, seed + i) for i in range(len(params))
    ]
    return engine.generate(prompts, params, use_tqdm=False)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# --- JSON ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate_and_are_compact(engine, name):
    schema = SCHEMAS[name]
    spec = so(json=json.dumps(schema) if name == "pairs" else schema)
    outs = completions(generate(engine, mixed(spec), seed=len(name)))
    for c in outs:
        assert c.constrained and c.finish_reason == "stop", (c.finish_reason, c.text)
        value = json.loads(c.text)
        jsonschema.validate(value, schema)
        assert not re.search(r"\s", outside_strings(c.text)), c.text
        if name in CANONICAL:
            assert c.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert len({c.text for c in outs[1:]}) > 1, "the seeded samples should not all agree"
    assert_idle(engine)


def test_json_whitespace_flexible_is_accepted(llama_engine):
    schema = SCHEMAS["nested"]
    params = [sampled(so(json=schema, whitespace_flexible=True), 5, 4, max_tokens=400)]
    outs = completions(generate(llama_engine, params))
    done = [c for c in outs if c.finish_reason == "stop"]
    assert done, [c.text for c in outs]  # free whitespace is unbounded: most, not all, end
    for c in done:
        jsonschema.validate(json.loads(c.text), schema)
    # the flag changes the language: the random model takes the whitespace it is offered
    assert any(re.search(r"\s", outside_strings(c.text)) for c in outs)
    assert_idle(llama_engine)


# --- regex, choice, grammars -----------------------------------------------------------------


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(engine, pattern):
    # the last request ignores EOS: a complete match still ends it (finish reason "stop")
    params = [*mixed(so(regex=pattern)), sampled(so(regex=pattern), 13, 3, ignore_eos=True)]
    for c in completions(generate(engine, params, seed=7)):
        assert c.constrained and c.finish_reason == "stop", (c.finish_reason, c.text)
        assert re.fullmatch(pattern, c.text), c.text


def test_regex_cut_by_max_tokens_is_a_prefix_of_a_match(llama_engine):
    pattern = r"[a-z]{40,60}"  # at least ~10 tokens in this vocabulary
    outs = completions(generate(llama_engine, mixed(so(regex=pattern), max_tokens=4)))
    for c in outs:
        assert c.finish_reason == "length" and len(c.token_ids) == 4
        assert regex.fullmatch(pattern, c.text, partial=True), c.text


def test_choice_output_is_one_of_the_choices(engine):
    outs = completions(
        generate(
            engine,
            [*mixed(so(choice=CHOICES)), sampled(so(choice=CHOICES), 14, 3, ignore_eos=True)],
        )
    )
    for c in outs:
        assert c.constrained and c.finish_reason == "stop", (c.finish_reason, c.text)
        assert c.text in CHOICES
    assert len({c.text for c in outs}) > 1


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_lark_and_gbnf_grammar_outputs_parse(engine, name):
    grammar, equivalent = GRAMMARS[name]
    for c in completions(generate(engine, mixed(so(grammar=grammar)), seed=3)):
        assert c.constrained and c.finish_reason == "stop", (c.finish_reason, c.text)
        assert re.fullmatch(equivalent, c.text), c.text


# --- against Hugging Face logits --------------------------------------------------------------


@torch.inference_mode()
def hf_logits(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The unmasked logits that chose each output token: [len(output), vocab]."""
    logits = hf_model(model_dir)(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def test_constrained_logprobs_are_the_models_own(llama_engine, tiny_llama_dir):
    prompt = prompt_for(llama_engine.validator.vocab_size, 29, 100)
    spec = so(json=SCHEMAS["person"])
    (out,) = llama_engine.generate([prompt], sampled(spec, logprobs=1), use_tqdm=False)
    got = out.outputs[0]
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), SCHEMAS["person"])
    logits = hf_logits(tiny_llama_dir, prompt, got.token_ids)
    ref = logits.log_softmax(-1).gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    np.testing.assert_allclose(got.logprobs, ref.numpy(), rtol=0, atol=1e-4)
    # the mask did its work: several tokens were not the model's own choice ...
    assert (logits.argmax(-1) != torch.tensor(got.token_ids)).sum() >= 2
    # ... so the free greedy continuation differs (it matches Hugging Face's)
    free_ids, _ = hf_greedy(tiny_llama_dir, prompt, len(got.token_ids))
    (free,) = llama_engine.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=len(got.token_ids), ignore_eos=True),
        use_tqdm=False,
    )
    assert free.outputs[0].token_ids == free_ids and not free.outputs[0].constrained
    assert free_ids != got.token_ids


def partial_matches(tokenizer, pattern: str, text: str, pieces: list[str]) -> set[int]:
    """Tokens that keep `text` a prefix of a full match of `pattern` (special tokens never),
    plus EOS once `text` is a full match: every token the grammar may allow, found with the
    `regex` module's partial matching."""
    special = set(tokenizer.all_special_ids)
    allowed = {
        t
        for t, piece in enumerate(pieces)
        if t not in special and regex.fullmatch(pattern, text + piece, partial=True)
    }
    if re.fullmatch(pattern, text):
        allowed.add(tokenizer.eos_token_id)
    return allowed


def mask_of(matcher, vocab: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab]).tolist())


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_constrained_is_the_argmax_within_the_mask(fixture, request):
    """A batch of regex-constrained and free greedy requests: each constrained token is the
    best, by Hugging Face's logits, of the tokens a matcher of our own allows (llguidance
    for the language: it also keeps forced text canonically tokenized, so its mask may be a
    subset of the partial matches, never more); a sequence ends exactly when the grammar is
    complete or EOS was chosen; free rows are untouched by the other rows' masks."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue(fixture)
    engine = request.getfixturevalue(fixture.replace("tiny_", "").replace("_dir", "_engine"))
    vocab = engine.validator.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    pieces = [tokenizer.decode([t]) for t in range(vocab)]
    eos = tokenizer.eos_token_id
    specs = [REGEXES[0], None, REGEXES[1], None, REGEXES[2]]
    params = [
        sampled(so(regex=p))
        if p
        else SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for p in specs
    ]
    prompts = [prompt_for(vocab, 17 + 6 * i, 50 + i) for i in range(5)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, pattern, out in zip(prompts, specs, outs):
        ids = out.outputs[0].token_ids
        if pattern is None:
            assert ids == hf_greedy(model_dir, prompt, 10)[0]
            continue
        logits = hf_logits(model_dir, prompt, ids)
        matcher = llguidance.LLMatcher(
            ll_tokenizer, llguidance.LLMatcher.grammar_from_regex(pattern)
        )
        text = ""
        for step, token in enumerate(ids):
            allowed = sorted(mask_of(matcher, vocab))
            assert set(allowed) <= partial_matches(tokenizer, pattern, text, pieces)
            assert token == allowed[int(logits[step, allowed].argmax())], (step, text)
            assert matcher.consume_token(token)
            text += pieces[token] if token != eos else ""
        assert re.fullmatch(pattern, text) and matcher.is_stopped(), text
        assert ids[-1] == eos or partial_matches(tokenizer, pattern, text, pieces) == {eos}
