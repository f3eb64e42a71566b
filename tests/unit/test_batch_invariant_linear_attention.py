"""The batch-invariant linear-attention backend (kernels/linear_attention/invariant.py): a
sequence's conv and delta-rule outputs, and the states it leaves, are equal (==) whether its
tokens run in one prefill, in prefill chunks beside other sequences, or one by one in decode
batches of any size, at a real model's head sizes (a state above torch's parallel grain, so
two threads split its reductions); and they stay close to the reference backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.linear_attention import get_linear_backend
from raylane.kernels.linear_attention.metadata import StateMetadata

HK, HV, DK, DV, W = 4, 8, 128, 128, 4  # Qwen3.5's head dims, fewer heads
C = 2 * HK * DK + HV * DV
LENGTHS = {"a": 23, "b": 9, "c": 14, "d": 5}
SLOTS = {"a": 3, "b": 0, "c": 5, "d": 1}

# (name, first token, token count, prefill?) per row; prefills first, as the planner orders
ALONE = [[("a", 0, 23, True)]]
MIXED = [
    [("b", 0, 9, True), ("a", 0, 7, True)],
    [("c", 0, 14, True), ("a", 7, 16, True), ("b", 9, 1, False)],
    [("d", 0, 5, True), ("a", 23, 1, False), ("c", 14, 1, False), ("b", 10, 1, False)],
]
ONE_BY_ONE = [[("a", t, 1, False)] for t in range(24)]  # every token a decode (preemption-free)


def make_inputs(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per sequence (conv input [L, C], then q, k, v, g, beta): 24 tokens of each."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(24, *shape, generator=gen)

    return {
        name: (
            rand(C).to(dtype),
            rand(HK, DK).to(dtype),
            rand(HK, DK).to(dtype),
            rand(HV, DV).to(dtype),
            -F.softplus(rand(HV)),
            rand(HV).sigmoid().to(dtype),
        )  # fmt: skip
        for name in LENGTHS
    }


def meta_for(rows: list[tuple[str, int, int, bool]]) -> StateMetadata:
    qsl = [0]
    for _, _, n, _ in rows:
        qsl.append(qsl[-1] + n)
    num_prefills = sum(prefill for *_, prefill in rows)
    slots = [SLOTS[name] for name, *_ in rows]
    return StateMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        state_slots=torch.tensor(slots),
        num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills],
        max_query_len=max(n for _, _, n, _ in rows),
        query_start_loc_host=qsl,
        state_slots_host=slots,
    )


def run(backend, steps, inputs, weight, dtype):
    """Sequence a's conv and delta-rule outputs by position, and its conv and recurrent state."""
    conv_state = torch.zeros(8, C, W - 1, dtype=dtype)
    state = torch.zeros(8, HV, DK, DV)
    conv_out, delta_out = {}, {}
    for rows in steps:
        meta = meta_for(rows)
        parts = [torch.cat([inputs[n][i][t : t + c] for n, t, c, _ in rows]) for i in range(6)]
        mixed = backend.conv(parts[0], weight, None, conv_state, meta)
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
        args = (q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, HV, DV), *parts[4:])
        out = backend.delta_rule(*args, state, meta)
        at = 0
        for name, t, c, _ in rows:
            for j in range(c):
                if name == "a":
                    conv_out[t + j], delta_out[t + j] = mixed[at + j], out[at + j]
            at += c
    return conv_out, delta_out, conv_state[SLOTS["a"]], state[SLOTS["a"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_equals_itself_alone_mixed_and_one_by_one(dtype):
    inputs = make_inputs(dtype)
    weight = torch.randn(C, W, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.5
    backend = get_linear_backend("batch_invariant")
    alone = run(backend, ALONE, inputs, weight, dtype)
    mixed, one_by_one = (run(backend, s, inputs, weight, dtype) for s in (MIXED, ONE_BY_ONE))
    for got in (mixed, one_by_one):
        for pos in range(23):  # the prompt's outputs, wherever they ran
            assert torch.equal(got[0][pos], alone[0][pos]), f"conv output {pos}"
            assert torch.equal(got[1][pos], alone[1][pos]), f"delta-rule output {pos}"
    # the decode of token 23 (in a batch of 3, or alone) and the states it leaves
    assert torch.equal(mixed[0][23], one_by_one[0][23])
    assert torch.equal(mixed[1][23], one_by_one[1][23])
    assert torch.equal(mixed[2], one_by_one[2])
    assert torch.equal(mixed[3], one_by_one[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_the_reference_backend(dtype):
    inputs = make_inputs(dtype)
    weight = torch.randn(C, W, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.5
    got = run(get_linear_backend("batch_invariant"), MIXED, inputs, weight, dtype)
    want = run(get_linear_backend("torch"), MIXED, inputs, weight, dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for pos in range(24):
        for i in (0, 1):
            torch.testing.assert_close(got[i][pos], want[i][pos], atol=tol, rtol=tol)
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)  # raw inputs, copied
    torch.testing.assert_close(got[3], want[3], atol=tol, rtol=tol)
