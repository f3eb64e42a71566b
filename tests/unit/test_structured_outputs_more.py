"""Structured outputs beyond the basics: a recursive grammar; bad specs raise ValueError naming
the field and leave nothing behind; async scheduling against the serial engine; seeded
constrained sampling alone against in a batch; the prefix cache, preemption and chunked prefill
against a cold, roomy engine; the n samples of a request each with their own grammar state."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams

from tests.tiny_models import VOCAB_SIZE
from tests.unit.async_helpers import assert_same, drive, run_both, token_ids
from tests.unit.test_structured_outputs import (
    CHOICES,
    GRAMMARS,
    REGEXES,
    SCHEMAS,
    assert_idle,
    completions,
    generate,
    mixed,
    prompt_for,
    sampled,
    so,
)

# a recursive (depth-bounded) Lark grammar: a list of digits and of lists of digits
NESTED_LARK = (
    'start: list\nlist: "[" [item ("," item)~0..2] "]"\nitem: DIGIT | inner\n'
    'inner: "[" [DIGIT ("," DIGIT)~0..2] "]"\nDIGIT: /[0-9]/\n'
)

GOOD = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(regex=REGEXES[0]))


def engine_for(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=model_dir, **kw))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    engine = engine_for(tiny_llama_dir)
    yield engine
    engine.shutdown()


def assert_valid(c, spec: StructuredOutputsParams) -> None:
    """A finished constrained completion is in its spec's language (independent checks)."""
    assert c.constrained and c.finish_reason == "stop", (c.finish_reason, c.text)
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        jsonschema.validate(json.loads(c.text), schema)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, c.text), c.text
    elif spec.choice is not None:
        assert c.text in spec.choice
    else:
        (equivalent,) = [r for g, r in GRAMMARS.values() if g == spec.grammar]
        assert re.fullmatch(equivalent, c.text), c.text


# --- a recursive grammar -------------------------------------------------------------------


def test_recursive_lark_grammar_output_parses(engine):
    def check(node, depth: int) -> None:  # a list of up to 3 digits or such lists, depth <= 2
        assert isinstance(node, list) and len(node) <= 3 and depth <= 2
        for item in node:
            if isinstance(item, list):
                check(item, depth + 1)
            else:
                assert isinstance(item, int) and 0 <= item <= 9

    for c in completions(generate(engine, mixed(so(grammar=NESTED_LARK)), seed=4)):
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert " " not in c.text
        check(json.loads(c.text), 1)


# --- bad specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json_object": False},
        {"regex": "a", "choice": ["a"]},
        {"json": {}, "json_object": True},
        {"grammar": 'start: "a"', "regex": "a"},
    ],
)
def test_none_or_two_kinds_raise_in_the_constructor(kwargs):
    with pytest.raises(ValueError, match="structured_outputs must set exactly one of"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"regex": ""}, "regex"),
        ({"grammar": ""}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"json": 3}, "json"),
    ],
)
def test_malformed_fields_raise_in_the_constructor(kwargs, field):
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} must"):
        StructuredOutputsParams(**kwargs)


BAD_SPECS = [
    ({"json": {"type": "wat"}}, "json"),
    ({"json": '{"type": "object"'}, "json"),  # JSON text that does not parse
    ({"json": "[1, 2]"}, "json"),  # parses, but a schema is an object
    ({"json": {"type": "integer", "minimum": 5, "maximum": 2}}, "json"),  # unsatisfiable
    ({"json": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "json"),
    ({"regex": "a(("}, "regex"),
    ({"grammar": "start: foo\nfoo: (((\n"}, "grammar"),  # Lark syntax error
    ({"grammar": "start: undefined_rule\n"}, "grammar"),
    ({"grammar": 'root ::= "a" (\n'}, "grammar"),  # GBNF syntax error
]


@pytest.mark.parametrize("kwargs, field", BAD_SPECS)
def test_bad_spec_raises_at_add_request_and_leaks_nothing(engine, kwargs, field):
    prompt = prompt_for(engine.validator.vocab_size, 20, 1)
    bad = SamplingParams(max_tokens=8, structured_outputs=so(**kwargs))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}:"):
        engine.add_request("bad", prompt, bad)
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}:"):
        engine.generate([prompt], bad, use_tqdm=False)
    assert_idle(engine)
    (out,) = engine.generate([prompt], GOOD, use_tqdm=False)  # the engine serves on
    assert_valid(out.outputs[0], GOOD.structured_outputs)
    assert_idle(engine)


def test_generate_with_one_bad_spec_adds_no_request(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    try:
        prompt = prompt_for(engine.validator.vocab_size, 20, 2)
        bad = SamplingParams(max_tokens=8, structured_outputs=so(regex="a(("))
        with pytest.raises(ValueError, match=r"^structured_outputs\.regex:"):
            engine.generate([prompt, prompt], [GOOD, bad], use_tqdm=False)
        assert not engine.has_unfinished_requests()
        (out,) = engine.generate([prompt], GOOD, use_tqdm=False)  # and the next batch runs
        assert_valid(out.outputs[0], GOOD.structured_outputs)
    finally:
        engine.shutdown()


def test_a_grammar_that_rejects_its_own_token_ends_in_error_not_stop(tiny_llama_dir):
    """Text spelled as a special token: llguidance's mask allows only that token, which its
    matcher then refuses. The request must fail, not end "stop" with text outside the
    language."""
    engine = engine_for(tiny_llama_dir)
    try:
        special = engine.tokenizer.convert_ids_to_tokens(engine.tokenizer.all_special_ids[0])
        prompt = prompt_for(engine.validator.vocab_size, 20, 3)
        params = SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=so(choice=[special + "x"])
        )
        (out,) = engine.generate([prompt], params, use_tqdm=False)
        got = out.outputs[0]
        assert got.finish_reason == "error" and out.error and "grammar" in out.error
        assert_idle(engine)
    finally:
        engine.shutdown()


# --- the engine's machinery ------------------------------------------------------------------

SPECS = [
    so(json=SCHEMAS["nested"]),
    so(regex=REGEXES[1]),
    so(choice=CHOICES),
    so(grammar=GRAMMARS["gbnf"][0]),
    so(json=json.dumps(SCHEMAS["pairs"])),
]


def free(seed: int | None, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=1,
    )


def test_async_scheduling_matches_serial_for_a_mixed_workload(tiny_llama_dir):
    """Free and constrained requests run ahead together (grammar masks follow their plans):
    every token as in the serial engine."""
    vocab = VOCAB_SIZE
    arrivals = {
        0: [
            ("free0", prompt_for(vocab, 19, 0), free(None, 90)),
            ("free1", prompt_for(vocab, 17, 1), free(5, 80)),
        ],
        3: [
            ("json", prompt_for(vocab, 23, 2), sampled(SPECS[0], logprobs=1)),
            ("regex", prompt_for(vocab, 31, 3), sampled(SPECS[1], 7, 2, logprobs=1)),
        ],
        6: [
            ("choice", prompt_for(vocab, 40, 4), sampled(SPECS[2], 8, 2)),
            ("gbnf", prompt_for(vocab, 12, 5), sampled(SPECS[3])),
            ("pairs", prompt_for(vocab, 25, 6), sampled(SPECS[4], 9)),
        ],
    }
    specs = {
        "json": SPECS[0],
        "regex": SPECS[1],
        "choice": SPECS[2],
        "gbnf": SPECS[3],
        "pairs": SPECS[4],
    }
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals))
    assert_same(ahead, serial)
    for rid, out in serial.items():
        for c in out.outputs:
            if rid in specs:
                assert_valid(c, specs[rid])
            else:
                assert not c.constrained and c.finish_reason == "length"


def test_seeded_constrained_alone_equals_in_a_batch(engine):
    vocab = engine.validator.vocab_size
    prompts = [prompt_for(vocab, 14 + 5 * i, 20 + i) for i in range(7)]
    target = sampled(SPECS[0], 42, 2)
    (alone,) = engine.generate([prompts[3]], target, use_tqdm=False)
    others = [
        sampled(SPECS[1], 1),
        free(2),
        sampled(SPECS[4], 3, 2),
        sampled(SPECS[2]),
        free(None),
        sampled(SPECS[0], 4),
    ]
    batch = engine.generate(prompts, [*others[:3], target, *others[3:]], use_tqdm=False)
    assert token_ids({"t": batch[3]}) == token_ids({"t": alone})
    for c in alone.outputs:
        assert_valid(c, SPECS[0])
    assert_idle(engine)


def test_prefix_cache_hit_gives_the_same_constrained_output(engine):
    prompts = [prompt_for(engine.validator.vocab_size, 45, 300 + i) for i in range(3)]
    params = [sampled(SPECS[0], logprobs=1), sampled(SPECS[1], 17, 2), sampled(SPECS[4], 18)]
    cold = engine.generate(prompts, params, use_tqdm=False)
    warm = engine.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in cold)
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert_same({str(i): o for i, o in enumerate(warm)}, {str(i): o for i, o in enumerate(cold)})
    for spec, out in zip([SPECS[0], SPECS[1], SPECS[4]], warm):
        for c in out.outputs:
            assert_valid(c, spec)
    assert_idle(engine)


def test_preemption_and_chunked_prefill_keep_the_grammar_state(engine, tiny_llama_dir):
    """Room for about two sequences and 16 tokens a step: sequences are preempted and
    re-prefilled with their outputs, in chunks; their grammars carry on where they were."""
    vocab = engine.validator.vocab_size
    specs = [
        so(regex=r"[a-z]{30,40}"),
        SPECS[0],
        so(regex=r"[0-9]{30,40}"),
        SPECS[4],
        so(json=SCHEMAS["person"]),
    ]
    prompts = [prompt_for(vocab, 33 + 4 * i, 400 + i) for i in range(len(specs))]
    # max_tokens within the tight cache's room (the outputs end far sooner)
    params = [
        sampled(s, None if i % 2 else 30 + i, logprobs=1, max_tokens=100)
        for i, s in enumerate(specs)
    ]
    tight = engine_for(
        tiny_llama_dir,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        async_scheduling=False,
    )
    try:
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.scheduler.num_preemptions > 0
        assert_idle(tight)
    finally:
        tight.shutdown()
    ref = engine.generate(prompts, params, use_tqdm=False)
    assert_same(
        {str(i): o for i, o in enumerate(got)}, {str(i): o for i, o in enumerate(ref)}, atol=1e-4
    )
    for spec, out in zip(specs, got):
        assert_valid(out.outputs[0], spec)


def test_n_samples_each_follow_their_own_grammar_state(engine):
    """Sample 0 of a seeded request draws the same numbers as the request with n=1: with a
    matcher per sample its tokens are the same; every sample is valid, and they differ."""
    prompt = prompt_for(engine.validator.vocab_size, 26, 500)
    spec = so(json=SCHEMAS["person"])
    many, one = engine.generate(
        [prompt, prompt], [sampled(spec, 77, 5), sampled(spec, 77)], use_tqdm=False
    )
    assert many.outputs[0].token_ids == one.outputs[0].token_ids
    for c in completions([many, one]):
        assert_valid(c, spec)
    assert len({c.text for c in many.outputs}) > 1
    assert_idle(engine)
