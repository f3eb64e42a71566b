"""vLLM's offline loop (`add_request` / `step()` / `abort_request`) and `AsyncLLMEngine.generate`
answer in each request's `SamplingParams.output_kind`, as vLLM's do.

The reference is `LLMEngine.generate` on the same engine (a serial run of the same seeded
requests; a seeded sample's tokens depend only on its seed, index and position), and for an
aborted request the same request cut to the tokens it had.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
from raylane import RequestOutputKind
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.outputs import RequestOutput
from safetensors.torch import load_file

KINDS = list(RequestOutputKind)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17]]


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "async"])
def engine(request, tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, async_scheduling=request.param)
    )
    yield engine
    engine.shutdown()


def _params(kind: RequestOutputKind, **kw) -> SamplingParams:
    base = {"n": 2, "max_tokens": 14, "temperature": 0.9, "seed": 7, "logprobs": 1}
    return SamplingParams(**{**base, "ignore_eos": True, **kw, "output_kind": kind})


def _stop_for(engine: LLMEngine) -> str:
    """A stop string taken from the middle of the unstopped text: stops one sample early."""
    (full,) = engine.generate([PROMPTS[0]], _params(RequestOutputKind.CUMULATIVE), use_tqdm=False)
    text = full.outputs[0].text
    assert len(text) > 10
    return text[4:7]


def _loop(engine: LLMEngine, requests: dict[str, tuple], aborts: dict[int, str] | None = None):
    """vLLM's loop, verbatim but for the aborts: every output step() and abort_request gave,
    by request id."""
    aborts = aborts or {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    steps = 0
    while engine.has_unfinished_requests():
        if steps in aborts:
            for out in engine.abort_request(aborts[steps]):
                got[out.request_id].append(out)
        for out in engine.step():
            got[out.request_id].append(out)
        steps += 1
    return got


def _joined(outs: list[RequestOutput]) -> dict[int, dict]:
    """DELTA outputs folded by hand, per sample index."""
    samples: dict[int, dict] = {}
    for out in outs:
        for c in out.outputs:
            s = samples.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None})
            s["text"] += c.text
            s["ids"] += c.token_ids
            s["lps"] += c.logprobs or []
            s["finish"] = c.finish_reason
    return samples


def _same_final(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.finished and out.prompt_token_ids == ref.prompt_token_ids
    assert len(out.outputs) == len(ref.outputs)
    for c, r in zip(out.outputs, ref.outputs):
        assert (c.index, c.text, c.token_ids) == (r.index, r.text, r.token_ids)
        assert (c.logprobs, c.finish_reason, c.stop_reason) == (
            r.logprobs,
            r.finish_reason,
            r.stop_reason,
        )


def _check_kind(kind: RequestOutputKind, outs: list[RequestOutput], ref: RequestOutput) -> None:
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    if kind is not RequestOutputKind.DELTA:
        _same_final(outs[-1], ref)
        for before, after in zip(outs, outs[1:]):  # cumulative: each extends the last
            for b, a in zip(before.outputs, after.outputs):
                assert a.token_ids[: len(b.token_ids)] == b.token_ids
                assert a.text.startswith(b.text)
        return
    assert all(o.prompt_token_ids == ref.prompt_token_ids for o in outs)  # as vLLM's
    joined = _joined(outs)
    for r in ref.outputs:
        s = joined[r.index]
        assert (s["text"], s["ids"], s["lps"], s["finish"]) == (
            r.text,
            r.token_ids,
            r.logprobs,
            r.finish_reason,
        )


@pytest.mark.parametrize("stop", [False, True], ids=["free", "stop-string"])
def test_the_vllm_loop_equals_generate_for_every_kind(engine, stop):
    extra = {"stop": [_stop_for(engine)]} if stop else {}
    requests = {
        f"{kind.name}-{i}": (prompt, _params(kind, seed=7 + i, **extra))
        for kind in KINDS
        for i, prompt in enumerate(PROMPTS)
    }
    got = _loop(engine, requests)
    refs = engine.generate(
        [p for p, _ in requests.values()], [p for _, p in requests.values()], use_tqdm=False
    )
    stopped = 0
    for (rid, _), ref in zip(requests.items(), refs):
        kind = RequestOutputKind[rid.split("-")[0]]
        _check_kind(kind, got[rid], ref)
        stopped += sum(c.finish_reason == "stop" for c in ref.outputs)
    assert (stopped > 0) == stop  # the stop string did stop some samples
    assert not engine.shapers._shapers  # nothing is kept for ended requests


def test_an_abort_answers_in_the_requests_kind(engine):
    requests = {kind.name: (PROMPTS[1], _params(kind, max_tokens=30)) for kind in KINDS}
    got: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(4):
        for out in engine.step():
            got[out.request_id].append(out)
    for out in engine.abort_request(list(requests) + ["nobody"]):
        got[out.request_id].append(out)
    assert not engine.has_unfinished_requests() and not engine.shapers._shapers
    assert engine.step() == []
    (full,) = engine.generate([PROMPTS[1]], _params(RequestOutputKind.CUMULATIVE, max_tokens=30))
    for kind in KINDS:
        outs = got[kind.name]
        assert outs[-1].finished and all(c.finish_reason == "abort" for c in outs[-1].outputs)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        if kind is RequestOutputKind.DELTA:
            samples = {i: s["ids"] for i, s in _joined(outs).items()}
        else:
            samples = {c.index: c.token_ids for c in outs[-1].outputs}
        assert set(samples) == {0, 1}
        for c in full.outputs:  # what it had: a prefix of the whole run's tokens
            assert 0 < len(samples[c.index]) < 30
            assert samples[c.index] == c.token_ids[: len(samples[c.index])]


def test_a_stale_end_comes_from_the_next_step(engine):
    params = dataclasses.replace(_params(RequestOutputKind.CUMULATIVE, n=1), max_weight_lag=0)
    engine.add_request("s", PROMPTS[2], params)
    outs = engine.step()
    norm = load_file(os.path.join(engine.config.model, "model.safetensors"))["model.norm.weight"]
    engine.update_weights([("model.norm.weight", norm)])  # the same values: a new version
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stale"
    assert len(outs[-1].outputs[0].token_ids) >= len(outs[0].outputs[0].token_ids)


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_async_generate_follows_the_kind(engine, kind):
    params = _params(kind, stop=[_stop_for(engine)])

    async def run() -> list[RequestOutput]:
        aeng = AsyncLLMEngine(engine)
        try:
            return [o async for o in aeng.generate(PROMPTS[0], params, f"a-{kind.name}")]
        finally:
            await aeng.shutdown()

    outs = asyncio.run(run())
    (ref,) = engine.generate([PROMPTS[0]], params, use_tqdm=False)
    _check_kind(kind, outs, ref)
    assert len(outs) > 1 or kind is RequestOutputKind.FINAL_ONLY


def test_output_kind_must_be_the_enum():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
