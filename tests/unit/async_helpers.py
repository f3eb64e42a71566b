"""Helpers for the async-scheduling tests: one workload run with async scheduling off (the
serial reference) and on, stepped by hand so arrivals and aborts land between steps."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import EngineCoreOutput, RequestOutput

ATOL = 1e-5  # batch composition differs between the modes: fp32 rounding may, the math not
MAX_STEPS = 400  # every workload here ends in far fewer steps; more is a hang

# step index -> requests added before that step: (request id, prompt, params)
Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]


def engine_for(model_dir: str, async_scheduling: bool, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_kv_blocks", 128)  # no 1 GiB cache per engine on a shared machine
    return LLMEngine(EngineConfig(model=model_dir, async_scheduling=async_scheduling, **kw))


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random token prompts of the given lengths (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 1, "ignore_eos": True, **kw}
    )


def seeded(seed: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(
        **{
            "temperature": 0.8,
            "seed": seed,
            "max_tokens": max_tokens,
            "logprobs": 1,
            "ignore_eos": True,
            **kw,
        }
    )


def drive(
    engine: LLMEngine,
    arrivals: Arrivals,
    aborts: dict[int, list[str]] | None = None,
) -> dict[str, RequestOutput]:
    """Step the engine, adding and aborting requests before the given steps, until every
    request ended; returns each one's final (cumulative) output. Checks the stream on the way:
    outputs only grow, and nothing follows a request's final output (an abort's included)."""
    aborts = aborts or {}
    last_event = max([*arrivals, *aborts, 0])
    finals: dict[str, RequestOutput] = {}
    seen: dict[str, OutputAccumulator] = {}
    for step in range(MAX_STEPS):
        for rid, prompt, params in arrivals.get(step, []):
            engine.admit(rid, prompt, params)
        for rid in aborts.get(step, []):
            (delta,) = engine.abort_deltas(rid)
            check_stream(delta, finals, seen)
            out = finals[rid]
            assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
        if step > last_event and not engine.has_unfinished_requests():
            return finals
        for out in engine.step_deltas():
            check_stream(out, finals, seen)
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def check_stream(
    delta: EngineCoreOutput, finals: dict[str, RequestOutput], seen: dict[str, OutputAccumulator]
) -> None:
    """Fold a delta into its request's output; a finished one goes to `finals`."""
    rid = delta.request_id
    assert rid not in finals, f"{rid}: an output after its final one"
    if rid not in seen:
        assert delta.prompt_token_ids is not None, f"{rid}: the first output lacks the prompt"
    else:
        assert delta.prompt_token_ids is None, f"{rid}: the prompt was sent twice"
    acc = seen.setdefault(rid, OutputAccumulator())
    acc.add(delta)
    if delta.finished:
        finals[rid] = acc.output()


def lengths(seen: dict[str, OutputAccumulator]) -> dict[str, list[int]]:
    """Tokens reported so far, per request and sample."""
    return {rid: [len(c.token_ids) for c in acc.live().outputs] for rid, acc in seen.items()}


def run_both(model_dir: str, run: Callable[[LLMEngine], Any], **kw) -> tuple[Any, Any]:
    """`run` on a fresh engine with async scheduling off, then on: (serial, run_ahead).
    Both engines must end idle with every KV block free; only the async one plans ahead."""
    results = []
    for mode in (False, True):
        engine = engine_for(model_dir, mode, **kw)
        try:
            results.append(run(engine))
            assert_idle(engine)
            ahead = engine.stats.steps_planned_ahead
            assert engine.stats_snapshot()["counters"]["steps_planned_ahead"] == ahead
            assert (ahead > 0) if mode else (ahead == 0), (mode, ahead)
        finally:
            engine.shutdown()
    return results[0], results[1]


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left: a step still in flight belongs to finished requests and yields nothing."""
    assert not engine.has_unfinished_requests()
    assert engine.drain() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def assert_same(
    got: dict[str, RequestOutput], ref: dict[str, RequestOutput], atol: float = ATOL
) -> None:
    """Per request and sample: the same tokens, text, finish and stop reasons and routed
    experts; logprobs and top logprobs within `atol`."""
    assert got.keys() == ref.keys()
    for rid, r_req in ref.items():
        g_req = got[rid]
        assert g_req.finished and r_req.finished, rid
        assert len(g_req.outputs) == len(r_req.outputs), rid
        for g, r in zip(g_req.outputs, r_req.outputs):
            where = f"{rid}[{r.index}]"
            assert g.token_ids == r.token_ids, where
            assert (g.finish_reason, g.stop_reason) == (r.finish_reason, r.stop_reason), where
            assert g.text == r.text, where
            assert (g.logprobs is None) == (r.logprobs is None), where
            if r.logprobs is not None:
                np.testing.assert_allclose(g.logprobs, r.logprobs, rtol=0, atol=atol, err_msg=where)
                for g_top, r_top in zip(g.top_logprobs, r.top_logprobs):
                    assert g_top.keys() == r_top.keys(), where
                    assert all(abs(g_top[t] - v) <= atol for t, v in r_top.items()), where
            assert (g.routed_experts is None) == (r.routed_experts is None), where
            if r.routed_experts is not None:
                np.testing.assert_array_equal(g.routed_experts, r.routed_experts, err_msg=where)


def all_at_once(
    prompts: list[list[int]], params: list[SamplingParams], prefix: str = "r"
) -> Arrivals:
    return {0: [(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]}


def token_ids(outs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outs.items()}
