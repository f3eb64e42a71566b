"""IncrementalDetokenizer and StopChecker on the tiny byte-level BPE tokenizer from tests/."""

from __future__ import annotations

import functools
import random

import pytest
from raylane.actors.engine.detokenizer import IncrementalDetokenizer, StopChecker
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.sequence import Sequence

from tests.tiny_models import make_tokenizer

REPLACEMENT = "\ufffd"
PIECES = [
    "a",
    "b",
    " ",
    "the",
    " fox",
    ",",
    ".",
    "\n",
    "é",
    "ß",
    "中",
    "文字",
    "😀",
    "👍🏽",
    "🇫🇷",
    "€",
    " Paris",
    "ok!",
    "→",
    "ǅ",
]


@functools.cache
def tokenizer():
    return make_tokenizer()


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def stream(ids: list[int], skip: bool = True) -> list[str]:
    """The delta emitted after each token, as the engine feeds growing output ids."""
    detok = IncrementalDetokenizer(tokenizer(), skip_special_tokens=skip)
    return [detok.step(ids[:i]) for i in range(1, len(ids) + 1)]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))


# --- IncrementalDetokenizer -------------------------------------------------------------------


def test_multibyte_characters_are_split_over_several_tokens():
    # the point of the test: emoji and CJK arrive as byte fragments
    assert len(encode("😀")) > 1 and len(encode("中")) > 1


def test_random_texts_stream_to_the_full_decode():
    rng = random.Random(0)
    for _ in range(300):
        ids = encode(random_text(rng))
        assert "".join(stream(ids)) == tokenizer().decode(ids)


def test_text_is_emitted_as_soon_as_a_character_is_complete():
    rng = random.Random(1)
    for _ in range(100):
        ids = encode(random_text(rng))
        emitted = ""
        for i, delta in enumerate(stream(ids), start=1):
            emitted += delta
            so_far = tokenizer().decode(ids[:i])
            assert REPLACEMENT not in delta
            if not so_far.endswith(REPLACEMENT):
                assert emitted == so_far


def test_emoji_waits_for_its_last_byte():
    ids = encode("a😀")
    deltas = stream(ids)
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "😀"


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_the_full_decode(skip):
    rng = random.Random(2)
    vocab = len(tokenizer())
    checked = 0
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        full = tokenizer().decode(ids, skip_special_tokens=skip)
        if full.endswith(REPLACEMENT):
            continue  # an unfinished character at the very end is held back by design
        assert "".join(stream(ids, skip)) == full
        checked += 1
    assert checked > 200


def test_special_tokens_follow_skip_special_tokens():
    tok = tokenizer()
    ids = encode("hi") + [tok.eos_token_id]
    assert "".join(stream(ids, skip=True)) == "hi"
    assert "".join(stream(ids, skip=False)) == "hi" + tok.eos_token


# --- StopChecker ------------------------------------------------------------------------------

MAX_MODEL_LEN = 64


def generate(
    text_or_ids: str | list[int], max_model_len: int = MAX_MODEL_LEN, **params
) -> Sequence:
    """Feed the tokens one by one like the engine does until the checker finishes the sequence."""
    ids = encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    seq = Sequence("r", 0, [0], SamplingParams(**params), block_size=4)
    detok = IncrementalDetokenizer(tokenizer())
    checker = StopChecker([tokenizer().eos_token_id], max_model_len)
    for tok in ids:
        seq.append_token(tok, None, None)
        delta = detok.step(seq.output_token_ids)
        seq.text += delta
        checker.check(seq, delta)
        if seq.finish_reason is not None:
            break
    return seq


def test_stop_string_spanning_tokens():
    assert len(encode(" world!")) > 1
    seq = generate("Hello, world! How are you today?", stop=["world!"], max_tokens=50)
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "world!", "Hello, ")
    assert seq.output_token_ids == encode("Hello, world!")  # stops on the completing token


def test_include_stop_str_in_output():
    seq = generate(
        "Hello, world! How are you today?", stop="world!", include_stop_str_in_output=True
    )
    assert (seq.finish_reason, seq.text) == ("stop", "Hello, world!")


def test_text_after_the_stop_string_inside_a_token_is_cut():
    seq = generate("Hello, world! How", stop="wo")  # " w" + "or": the match ends mid-token
    assert seq.text == "Hello, "
    seq = generate("Hello, world! How", stop="wo", include_stop_str_in_output=True)
    assert seq.text == "Hello, wo"


def test_output_never_contains_a_stop_string():
    # " the" is one token: both stops complete at once and the earlier one must win
    assert len(encode(" the")) == 1
    seq = generate("a the", stop=["he", " t"])
    assert seq.finish_reason == "stop" and seq.text == "a"
    assert seq.stop_reason == " t"


def naive_stop(text_steps: list[str], stops: list[str]) -> str | None:
    """Cut the text at the earliest stop occurrence, at the first step where one appears."""
    for text in text_steps:
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)]
    return None


def test_random_texts_with_stop_strings_match_the_naive_cut():
    rng = random.Random(3)
    for _ in range(200):
        text = random_text(rng)
        stops = rng.sample(["a", "b", " ", "中", "😀", "the", "e,", "ok", ".\n", "文"], 3)
        ids = encode(text)
        steps = [tokenizer().decode(ids[:i]) for i in range(1, len(ids) + 1)]
        seq = generate(ids, stop=stops, max_tokens=len(ids))
        want = naive_stop([s for s in steps if not s.endswith(REPLACEMENT)], stops)
        if want is None:
            assert seq.finish_reason == "length" and seq.text == text
        else:
            assert seq.finish_reason == "stop" and seq.text == want


def test_stop_token_ids():
    ids = encode("Hello, world!")
    seq = generate(ids, stop_token_ids=[ids[3]])
    assert (seq.finish_reason, seq.stop_reason) == ("stop", ids[3])
    assert seq.output_token_ids == ids[:4]


def test_eos_stops_unless_ignored():
    eos = tokenizer().eos_token_id
    ids = encode("ab") + [eos] + encode("cd")
    seq = generate(ids, max_tokens=len(ids))
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", None, "ab")
    seq = generate(ids, max_tokens=len(ids), ignore_eos=True)
    assert seq.finish_reason == "length" and seq.output_token_ids == ids


def test_min_tokens_delays_every_stop():
    eos = tokenizer().eos_token_id
    ids = [eos] + encode("xy") + [eos]
    seq = generate(ids, min_tokens=2)
    assert seq.finish_reason == "stop" and seq.num_output_tokens == len(ids)
    ids = encode("Hello")
    seq = generate(ids, stop_token_ids=[ids[0]], min_tokens=1)
    assert seq.finish_reason == "stop" and seq.num_output_tokens == 1
    seq = generate(ids + ids, stop_token_ids=[ids[0]], min_tokens=2)
    assert seq.num_output_tokens == len(ids) + 1
    text_ids = encode("ab ab ab")
    assert tokenizer().convert_ids_to_tokens(text_ids) == ["a", "b", "Ġa", "b", "Ġa", "b"]
    assert generate(text_ids, stop="ab").text == ""
    seq = generate(text_ids, stop="ab", min_tokens=3)  # the first "ab" came too early
    assert (seq.finish_reason, seq.text, seq.num_output_tokens) == ("stop", "ab ", 4)


def test_max_tokens_gives_length():
    seq = generate("Hello, world! How are you today?", max_tokens=3)
    assert (seq.finish_reason, seq.num_output_tokens) == ("length", 3)
    assert seq.stop_reason is None


def test_max_model_len_gives_length():
    seq = generate("Hello, world! How are you today?", max_model_len=5, max_tokens=None)
    assert seq.finish_reason == "length" and len(seq) == 5
