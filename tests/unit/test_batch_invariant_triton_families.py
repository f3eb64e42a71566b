"""The batch-invariant mode's CUDA forms of MLA, DSA and Gated DeltaNet (issue 42), run under
Triton's CPU interpreter with the mode's CUDA path forced onto CPU tensors (`on_triton`:
TRITON_INTERPRET=1 and RAYLANE_TRITON_ON_CPU=1): the recurrent gated delta rule
(triton_gdn.py), DSA's per-token matmuls and softmax (triton_dsa.py), MLA's expanded form as
one-split decodes (triton_mla.py). A row's result must be bit-identical (torch.equal) alone, in
a mixed batch and under chunked prefill, and close to an independent reference (float64 math
in the test, or the CPU path of the mode). tl.dot is not taken under the interpreter (see
test_batch_invariant_triton.py); tests/gpu/test_gpu_batch_invariant.py checks it on CUDA.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from raylane.kernels.attention.builder import SeqSlice, build_metadata  # noqa: E402
from raylane.kernels.attention.registry import TRITON_ON_CPU  # noqa: E402
from raylane.kernels.attention.sparse import select_topk, sparse_latent_attention  # noqa: E402
from raylane.kernels.batch_invariant import gated_delta_net  # noqa: E402
from raylane.kernels.batch_invariant.backend import on_triton  # noqa: E402
from raylane.kernels.batch_invariant.triton_dsa import softmax, token_matmul  # noqa: E402
from raylane.kernels.batch_invariant.triton_mla import expanded_attention  # noqa: E402
from raylane.kernels.linear_attention import get_linear_backend  # noqa: E402
from raylane.kernels.linear_attention.gated_delta import recurrent_gated_delta_rule  # noqa: E402

from tests.unit import test_batch_invariant_linear_attention as gdn  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture
def triton_path(monkeypatch):
    """The mode's CUDA path on CPU tensors (the registry's `triton_on_cpu`)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(TRITON_ON_CPU, "1")
    assert on_triton(torch.device("cpu"))


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- Gated DeltaNet --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_rule_is_the_same_alone_mixed_and_one_by_one(triton_path, dtype):
    # the engine's backend (linear_attention/invariant.py) on the Triton recurrence: sequence
    # a's outputs and states, at Qwen3.5's head sizes, whatever shares its steps
    inputs = gdn.make_inputs(dtype)
    weight = _randn(gdn.C, gdn.W, seed=1, dtype=dtype) * 0.5
    backend = get_linear_backend("batch_invariant")
    alone = gdn.run(backend, gdn.ALONE, inputs, weight, dtype)
    mixed, one_by_one = (
        gdn.run(backend, s, inputs, weight, dtype) for s in (gdn.MIXED, gdn.ONE_BY_ONE)
    )
    for got in (mixed, one_by_one):
        for pos in range(23):
            assert torch.equal(got[1][pos], alone[1][pos]), f"delta-rule output {pos}"
    assert torch.equal(mixed[1][23], one_by_one[1][23])
    assert torch.equal(mixed[3], one_by_one[3])
    # close to the reference backend (the torch ops, chunked prefill, batched decode)
    want = gdn.run(get_linear_backend("torch"), gdn.MIXED, inputs, weight, dtype)
    for pos in range(24):
        torch.testing.assert_close(mixed[1][pos], want[1][pos], atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(mixed[3], want[3], atol=TOL[dtype], rtol=TOL[dtype])


def _trainer_inputs(dtype: torch.dtype, batch: int = 3, length: int = 6):
    hk, hv, dk, dv = 2, 4, 16, 8
    q, k = (_randn(batch, length, hk, dk, seed=s, dtype=dtype) for s in (2, 3))
    v = _randn(batch, length, hv, dv, seed=4, dtype=dtype)
    g = -torch.nn.functional.softplus(_randn(batch, length, hv, seed=5))
    beta = _randn(batch, length, hv, seed=6).sigmoid().to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_trainers_delta_rule_takes_the_triton_recurrence(triton_path, dtype):
    q, k, v, g, beta = _trainer_inputs(dtype)
    init = _randn(3, 4, 16, 8, seed=7)
    out, final = gated_delta_net.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    for b in range(3):  # each sequence alone: the same bits
        one = [x[b : b + 1] for x in (q, k, v, g, beta)]
        alone, alone_final = gated_delta_net.chunk_gated_delta_rule(
            *one, initial_state=init[b : b + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert torch.equal(alone[0], out[b]) and torch.equal(alone_final[0], final[b])
    # gated_delta.py's reference recurrence (einsums, in float32)
    want, want_final = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(final, want_final, atol=1e-4, rtol=1e-4)


def test_the_trainers_delta_rule_on_triton_has_transformers_gradients(triton_path):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    inputs = [x.requires_grad_() for x in _trainer_inputs(torch.float32)]
    out, _ = gated_delta_net.chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
    weights = _randn(*out.shape, seed=8)
    got = torch.autograd.grad((out * weights).sum(), inputs)
    q, k, v, g, beta = inputs  # transformers' chunked rule, its key heads repeated as its model
    q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    want_out, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((want_out * weights).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- DSA -------------------------------------------------------------------------------------

BLOCK, NH, D, H, L, R, TOPK = 4, 4, 16, 4, 32, 8, 6
DSA_LENGTHS = [9, 4, 14]
DSA_TABLES = [[5, 1, 9], [3], [0, 7, 2, 8]]  # blocks of 4 slots
DSA_SCENARIOS = {  # steps of (sequence, first new position, end)
    "mixed": [[(0, 0, 9), (1, 0, 4), (2, 0, 14)]],
    "chunked": [
        [(2, 0, 6), (0, 0, 2)],
        [(0, 2, 8), (1, 0, 4), (2, 6, 13)],
        [(0, 8, 9), (2, 13, 14)],
    ],
}


class DsaInputs:
    """Every position's indexer query, weights, key, MLA query and latent row, in caches that
    already hold every position (the layer stores a step's rows before it reads)."""

    def __init__(self, dtype: torch.dtype) -> None:
        n = 40  # slots
        self.keys = _randn(n, 1, D, seed=10, dtype=dtype)
        self.latent = _randn(n, 1, L + R, seed=11, dtype=dtype)
        self.q = [_randn(t, NH, D, seed=20 + i, dtype=dtype) for i, t in enumerate(DSA_LENGTHS)]
        self.w = [_randn(t, NH, seed=30 + i) for i, t in enumerate(DSA_LENGTHS)]
        self.mq = [_randn(t, H, L + R, seed=40 + i, dtype=dtype) for i, t in enumerate(DSA_LENGTHS)]

    def step(self, rows) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """(sequence, start, end) rows, prefills first -> {(sequence, pos): (chosen, out)}."""
        decode = [r for r in rows if r[2] - r[1] == 1 and r[1] > 0]
        rows = [r for r in rows if r not in decode] + decode
        slices = [SeqSlice(e - s, e, DSA_TABLES[i]) for i, s, e in rows]
        meta = build_metadata(
            slices[: len(rows) - len(decode)], slices[len(rows) - len(decode) :], BLOCK
        )
        cat = lambda xs: torch.cat([xs[i][s:e] for i, s, e in rows])  # noqa: E731
        chosen = select_topk(cat(self.q), cat(self.w), self.keys, meta, TOPK, 0.3, invariant=True)
        out = sparse_latent_attention(
            cat(self.mq), self.latent, L, chosen, meta, 0.2, invariant=True
        )
        keys = [(i, p) for i, s, e in rows for p in range(s, e)]
        return {key: (chosen[j], out[j]) for j, key in enumerate(keys)}


def _dsa_reference(
    inputs: DsaInputs, i: int, pos: int, chosen: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """float64: the indexer's score of every position <= pos, and MLA's absorbed attention over
    `chosen` (the kernel's picks, so that near-ties cannot make the outputs incomparable)."""
    table = DSA_TABLES[i]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + 1)]
    k = inputs.keys[slots, 0].double()
    heads = (inputs.q[i][pos].double() @ k.T * 0.3).relu()  # [NH, pos + 1]
    scores = inputs.w[i][pos].double() @ heads
    rows = inputs.latent[[slots[p] for p in chosen.tolist() if p >= 0], 0].double()
    probs = torch.softmax(inputs.mq[i][pos].double() @ rows.T * 0.2, -1)
    return scores, probs @ rows[:, :L]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dsa_picks_and_attention_are_the_same_alone_mixed_and_chunked(triton_path, dtype):
    inputs = DsaInputs(dtype)
    alone = {}
    for i, n in enumerate(DSA_LENGTHS):
        alone.update(inputs.step([(i, 0, n)]))
    for name, steps in DSA_SCENARIOS.items():
        got = {}
        for rows in steps:
            got.update(inputs.step(rows))
        assert sorted(got) == sorted(alone), name
        for key, (chosen, out) in got.items():
            assert torch.equal(chosen, alone[key][0]), (name, key)
            assert torch.equal(out, alone[key][1]), (name, key)
    for (i, pos), (chosen, out) in alone.items():
        scores, want = _dsa_reference(inputs, i, pos, chosen)
        best = torch.sort(scores, descending=True, stable=True).indices[:TOPK].sort().values
        if dtype == torch.float32:  # bf16 keys can tie or swap near-equal scores
            assert chosen[chosen >= 0].tolist() == best.tolist(), (i, pos)
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_dsa_zero_scores_are_positive_and_tie_to_the_earlier_position(triton_path):
    # every head's ReLU zero and the head weights negative: each score a sum of -0.0 products,
    # which must come out +0 (a radix sort, as CUDA's may be, ranks -0 below +0) and tie
    meta = build_metadata([SeqSlice(9, 9, DSA_TABLES[0])], [], BLOCK)
    keys = torch.ones(40, 1, D)
    q, w = -torch.ones(9, NH, D), -torch.ones(9, NH)
    from raylane.kernels.attention.sparse import _scores_on_triton, context_slots, token_positions

    slots = context_slots(meta, token_positions(meta)[0])
    scores = _scores_on_triton(q, w, keys[:, 0], slots, 0.3)
    assert (scores == 0).all() and not torch.signbit(scores).any()
    chosen = select_topk(q, w, keys, meta, TOPK, 0.3, invariant=True)
    assert chosen[8].tolist() == list(range(TOPK))  # the earliest positions win the tie


def test_token_matmul_and_softmax_gradients_are_torch_s(triton_path):
    a, b = _randn(3, 5, 7, seed=50).requires_grad_(), _randn(3, 6, 7, seed=51).requires_grad_()
    x = _randn(3, 5, 6, seed=52).requires_grad_()
    mix = _randn(3, 5, 6, seed=53)
    got = torch.autograd.grad((softmax(token_matmul(a, b) + x) * mix).sum(), (a, b, x))
    want = torch.autograd.grad(
        (torch.softmax(a @ b.transpose(1, 2) + x, -1) * mix).sum(), (a, b, x)
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# --- MLA -------------------------------------------------------------------------------------

NOPE, V = 8, 12
MLA_LENGTHS = [7, 3, 10]
MLA_TABLES = [[4, 0], [6], [1, 5, 3]]


def _expand(w: torch.Tensor):
    """Cache rows [N, 1, L + R] -> (keys [N, H, NOPE + R], values [N, H, V]) through the mode's
    linear (the Triton matmul here), as MLAttention.expand."""
    from raylane.kernels.batch_invariant import padded_linear

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent, rope = rows[:, 0].split([L, R], dim=-1)
        kv = padded_linear(latent, w).view(rows.shape[0], H, NOPE + V)
        k_nope, value = kv.split([NOPE, V], dim=-1)
        key = torch.cat([k_nope, rope[:, None].expand(-1, H, R)], dim=-1)
        return key.contiguous(), value.contiguous()

    return expand


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_expanded_rows_are_the_same_alone_mixed_and_chunked(triton_path, dtype):
    latent = _randn(32, 1, L + R, seed=60, dtype=dtype)
    w = _randn(H * (NOPE + V), L, seed=61, dtype=dtype) / 6
    qs = [_randn(n, H, NOPE + R, seed=62 + i, dtype=dtype) for i, n in enumerate(MLA_LENGTHS)]
    expand = _expand(w)

    def step(rows):
        slices = [SeqSlice(e - s, e, MLA_TABLES[i]) for i, s, e in rows]
        meta = build_metadata(slices, [], BLOCK)
        out = expanded_attention(
            torch.cat([qs[i][s:e] for i, s, e in rows]), latent, meta, expand, 0.25
        )
        return dict(zip([(i, p) for i, s, e in rows for p in range(s, e)], out))

    alone = {}
    for i, n in enumerate(MLA_LENGTHS):
        alone.update(step([(i, 0, n)]))
    for steps in (
        [[(0, 0, 7), (1, 0, 3), (2, 0, 10)]],
        [[(2, 0, 4), (0, 0, 5)], [(0, 5, 7), (1, 0, 3), (2, 4, 10)]],
    ):
        got = {}
        for rows in steps:
            got.update(step(rows))
        assert sorted(got) == sorted(alone)
        for key, row in got.items():
            assert torch.equal(row, alone[key]), key
    # float64 expanded attention: keys / values from the float64 kv_b product
    for (i, pos), row in alone.items():
        slots = [MLA_TABLES[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(pos + 1)]
        rows = latent[slots, 0].double()
        kv = (rows[:, :L] @ w.double().T).view(-1, H, NOPE + V)
        keys = torch.cat([kv[..., :NOPE], rows[:, None, L:].expand(-1, H, R)], -1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", qs[i][pos].double(), keys) * 0.25, -1)
        want = torch.einsum("hn,nhv->hv", probs, kv[..., NOPE:])
        torch.testing.assert_close(row.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
