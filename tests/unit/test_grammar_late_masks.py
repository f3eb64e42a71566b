"""Grammar masks off the critical path: constrained batches plan ahead like free ones, their
masks reach the runner after the plan, and a mask that is still being computed holds only its
own row. References: the serial engine, a run without the injected slow grammar, and a naive
mask application."""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from raylane.actors.engine import SamplingParams
from raylane.actors.runner.mask_board import SKIP, MaskBoard, step_masks
from raylane.actors.runner.plan import StepPlan
from raylane.kernels.sampling import unpack_token_bitmask

from tests.unit.async_helpers import engine_for
from tests.unit.test_structured_outputs import REGEXES, prompt_for, sampled, so

GATE_AT = 2  # the slow grammar stalls before its third token


class GatedMatcher:
    """A real llguidance matcher whose mask computation, once it has taken GATE_AT tokens,
    waits for `gate` (a scripted slow grammar state: it tests the scheduling, not the grammar)."""

    def __init__(self, inner, gate: threading.Event):
        self.inner, self.gate, self.consumed = inner, gate, 0
        self.gate_opened: bool | None = None  # True: opened by the test, False: timed out

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        if self.consumed == GATE_AT and self.gate_opened is None:
            self.gate_opened = self.gate.wait(60)
        self.inner.unsafe_compute_mask_ptr(pointer, size)

    def consume_token(self, token: int) -> bool:
        self.consumed += 1
        return self.inner.consume_token(token)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def constrained(seed: int) -> SamplingParams:
    return sampled(so(regex=REGEXES[1]), seed, logprobs=1)


def free() -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)


def run(engine, slow: bool, tag: str) -> tuple[dict, int]:
    """A constrained and a free request side by side; with `slow`, the constrained one's
    grammar stalls until the free one has finished. Returns (outputs by name, the step
    at which the free one finished)."""
    vocab = engine.validator.vocab_size
    engine.admit(f"c{tag}", prompt_for(vocab, 21, 1), constrained(5))
    engine.admit(f"f{tag}", prompt_for(vocab, 17, 2), free())
    gate = threading.Event()
    if slow:
        seq = engine.requests[f"c{tag}"].seqs[0]
        seq.matcher = GatedMatcher(seq.matcher, gate)
    outputs: dict[str, dict] = {"c": {}, "f": {}}
    free_done_at = -1
    for step in range(400):
        for delta in engine.step_deltas():
            got = outputs[delta.request_id[0]]
            got["ids"] = got.get("ids", []) + list(delta.outputs[0].token_ids)
            got["lps"] = got.get("lps", []) + list(delta.outputs[0].logprobs or [])
            if delta.finished:
                got["finish"] = delta.outputs[0].finish_reason
                if delta.request_id[0] == "f":
                    free_done_at = step
                    gate.set()
        if not engine.has_unfinished_requests():
            break
    if slow:
        assert seq.matcher.gate_opened is True, "the batch waited for the slow grammar"
    return outputs, free_done_at


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_late_mask_skips_its_row_while_the_batch_goes_on(tiny_llama_dir, async_scheduling):
    engine = engine_for(tiny_llama_dir, async_scheduling)
    try:
        engine.executor.mask_board.wait_s = 0.0  # a row not ready at the end of its forward
        ref, _ = run(engine, slow=False, tag="0")
        skips_before = engine.stats.grammar_skips
        got, free_done_at = run(engine, slow=True, tag="1")
        # the free request finished while the constrained one waited on its third token ...
        assert free_done_at >= 0 and engine.stats.grammar_skips - skips_before >= 1
        # ... and both came out as without the stall: skipping redoes the row's position
        # with the same seeded draw
        for name in ("c", "f"):
            assert got[name]["ids"] == ref[name]["ids"], name
            np.testing.assert_allclose(got[name]["lps"], ref[name]["lps"], atol=1e-5)
        text = engine.tokenizer.decode(got["c"]["ids"], skip_special_tokens=True)
        assert got["c"]["finish"] == "stop" and re.fullmatch(REGEXES[1], text), text
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_constrained_batches_plan_ahead(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, True)
    try:
        vocab = engine.validator.vocab_size
        prompts = [prompt_for(vocab, 15 + i, 30 + i) for i in range(4)]
        outs = engine.generate(prompts, [constrained(i) for i in range(4)], use_tqdm=False)
        assert all(re.fullmatch(REGEXES[1], o.outputs[0].text) for o in outs)
        steps = engine.stats.step_times.steps
        assert engine.stats.steps_planned_ahead >= steps - len(prompts) - 1, steps
    finally:
        engine.shutdown()


def done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_mask_board_skips_late_rows_only_when_another_row_samples():
    board = MaskBoard(wait_s=0.0)
    mask = np.full(4, -1, np.int32)
    late: Future = Future()
    board.post(7, {1: done(mask), 2: late})
    got = board.take(7, skippable={1, 2}, num_sampling=2)
    assert got[1] is mask and got[2] is SKIP
    # alone in its step (or not skippable), a late row is waited for, not skipped
    for skippable, num_sampling in (({2}, 1), (set(), 2)):
        late = Future()
        board.post(8, {2: late})
        threading.Timer(0.05, late.set_result, (mask,)).start()
        assert board.take(8, skippable, num_sampling)[2] is mask
    # a runner waiting for masks that will never come (the executor shuts down) gives up
    threading.Timer(0.05, board.close).start()
    with pytest.raises(RuntimeError, match="shut down"):
        board.take(9, set(), 1)


@pytest.mark.parametrize("can_skip", [True, False])
def test_rows_of_a_model_with_recurrent_state_never_skip(can_skip):
    # linear attention cannot redo a position (its state would take the token twice), so
    # step_masks(can_skip=False) waits for a late row's mask where it would otherwise skip
    board, mask, late = MaskBoard(wait_s=0.0), np.full(4, -1, np.int32), Future()
    board.post(3, {1: done(mask), 2: late})
    threading.Timer(0.05, late.set_result, (mask,)).start()
    rows = [
        SimpleNamespace(samples=True, num_new=1, drafts=(), state=SimpleNamespace(seq_id=i))
        for i in (1, 2)
    ]
    plan = StepPlan(step_id=3, late_masks=(1, 2))
    got = step_masks(board, plan, rows, can_skip=can_skip)  # type: ignore[arg-type]
    assert got[1] is mask and (got[2] is SKIP) == can_skip


def test_bitmask_application_matches_a_naive_one():
    """The sampler's packed-bitmask path against a per-token Python loop."""
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32
    words = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    got = unpack_token_bitmask(torch.from_numpy(words), vocab)
    naive = [
        [bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)
    ]
    assert got.tolist() == naive
