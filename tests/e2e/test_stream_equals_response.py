"""A streamed response is the non-streamed one cut into pieces: for the same seeded request,
each choice's deltas join to the response's text, tokens and logprobs (n > 1, stop strings,
logprobs), and both equal the offline engine's output (the independent reference)."""

from __future__ import annotations

from raylane.actors.engine import SamplingParams

from tests.e2e.conftest import MODEL

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
SEEDED = {"temperature": 1.0, "seed": 7, "max_tokens": 24}


def _stop_from(ref_engine, prompt) -> str:
    """A stop string taken from the middle of the unstopped output, so it surely fires."""
    ref = ref_engine.generate([prompt], SamplingParams(**SEEDED, n=2, ignore_eos=True))[0]
    text = ref.outputs[0].text
    assert len(text) > 12
    return text[8:11]


def test_streamed_completion_joins_to_the_response(client, ref_engine):
    stop = _stop_from(ref_engine, PROMPT)
    kw = dict(model=MODEL, prompt=PROMPT, n=2, logprobs=2, stop=[stop], **SEEDED)
    kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**kw)
    parts: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            p = parts.setdefault(ch.index, {"text": "", "tokens": [], "lps": [], "ids": []})
            p["text"] += ch.text
            if ch.logprobs is not None:
                p["tokens"] += ch.logprobs.tokens
                p["lps"] += ch.logprobs.token_logprobs
            p["ids"] += ch.model_extra.get("token_ids") or []
            if ch.finish_reason is not None:
                p["finish"] = (ch.finish_reason, ch.model_extra.get("stop_reason"))
    ref = ref_engine.generate(
        [PROMPT], SamplingParams(**SEEDED, n=2, logprobs=2, stop=[stop], ignore_eos=True)
    )[0]
    assert sorted(parts) == [0, 1]
    for choice in whole.choices:
        p, want = parts[choice.index], ref.outputs[choice.index]
        assert p["text"] == choice.text == want.text
        assert stop not in p["text"]
        assert p["ids"] == choice.model_extra["token_ids"] == want.token_ids
        assert p["tokens"] == choice.logprobs.tokens
        assert p["lps"] == choice.logprobs.token_logprobs
        assert p["finish"] == (choice.finish_reason, choice.model_extra["stop_reason"])
        assert choice.finish_reason == want.finish_reason
    assert parts[0]["finish"] == ("stop", stop)  # the stop string fired in choice 0


def test_streamed_chat_joins_to_the_response(client, ref_engine):
    kw = dict(model=MODEL, messages=MESSAGES, n=2, logprobs=True, top_logprobs=2, **SEEDED)
    kw["extra_body"] = {"ignore_eos": True}
    whole = client.chat.completions.create(**kw)
    parts: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            p = parts.setdefault(ch.index, {"text": "", "lps": [], "tops": []})
            p["text"] += ch.delta.content or ""
            for t in (ch.logprobs.content if ch.logprobs else None) or []:
                p["lps"].append((t.token, t.logprob))
                p["tops"].append([(x.token, x.logprob) for x in t.top_logprobs])
            if ch.finish_reason is not None:
                p["finish"] = ch.finish_reason
    ref = ref_engine.chat(MESSAGES, SamplingParams(**SEEDED, n=2, ignore_eos=True))[0]
    for choice in whole.choices:
        p = parts[choice.index]
        assert p["text"] == choice.message.content == ref.outputs[choice.index].text
        assert p["lps"] == [(t.token, t.logprob) for t in choice.logprobs.content]
        tops = [[(x.token, x.logprob) for x in t.top_logprobs] for t in choice.logprobs.content]
        assert p["tops"] == tops
        assert p["finish"] == choice.finish_reason
