"""The batch-invariant mode's Triton kernels for CUDA (issue 42), run under the CPU interpreter:
the fixed-tile matmul, the row-wise RMSNorm and log_softmax, and the attention backend's
invariant form (every query row a one-split decode). Each row's result must be bit-identical
(torch.equal) whatever rows share the call, and close to an independent reference (torch's
matmul, kernels/norm.py's RMSNorm, float64 log_softmax, the torch reference attention backend).

The interpreter's tl.dot is numpy's BLAS, whose rounding follows a row's place in the tile; the
matmul takes a sum of products there instead (see triton_matmul.py), so what is checked here is
the kernels' tiling and order, and tests/gpu/test_gpu_batch_invariant.py checks tl.dot on CUDA.
"""

from __future__ import annotations

import os

# before triton is imported (tests/conftest.py sets it already, for the whole session)
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from raylane.kernels.attention import BackendRequest, get_backend  # noqa: E402
from raylane.kernels.attention.builder import SeqSlice, build_metadata  # noqa: E402
from raylane.kernels.attention.torch_ref import TorchAttention  # noqa: E402
from raylane.kernels.attention.triton_backend import TritonAttention  # noqa: E402
from raylane.kernels.batch_invariant import batch_invariant_backend  # noqa: E402
from raylane.kernels.batch_invariant.triton_experts import expert_rows_linear  # noqa: E402
from raylane.kernels.batch_invariant.triton_matmul import (  # noqa: E402
    InvariantLinear,
    invariant_matmul,
)
from raylane.kernels.batch_invariant.triton_rowwise import log_softmax, rms_norm  # noqa: E402
from raylane.kernels.norm import rms_norm as torch_rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
COUNTS = [1, 3, 16, 17, 40]
# the interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest): up to one
# bf16 ulp (2^-7 relative) against a reference rounded to nearest
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_is_the_same_at_any_row_count(dtype):
    x, w, b = _randn(40, 50, dtype=dtype, seed=0), _randn(70, 50, dtype=dtype, seed=1), None
    b = _randn(70, dtype=dtype, seed=2)
    full = invariant_matmul(x, w, b)
    for m in COUNTS:
        assert torch.equal(invariant_matmul(x[:m], w, b), full[:m]), m
    for i in range(40):  # each row alone: row 0 of a tile instead of row i % 64
        assert torch.equal(invariant_matmul(x[i : i + 1], w, b)[0], full[i]), i
    # other rows beside it: row 5 amid different neighbours
    other = torch.cat(
        [_randn(5, 50, dtype=dtype, seed=3), x[5:6], _randn(11, 50, dtype=dtype, seed=4)]
    )
    assert torch.equal(invariant_matmul(other, w, b)[5], full[5])
    ref = x.double() @ w.double().T + b.double()
    assert full.dtype == dtype
    torch.testing.assert_close(full.double(), ref, atol=TOL[dtype] * 8, rtol=TOL[dtype])
    # against torch's own linear (the engine's path without the mode)
    torch.testing.assert_close(
        full.float(),
        torch.nn.functional.linear(x, w, b).float(),
        atol=TOL[dtype] * 8,
        rtol=TOL[dtype],
    )


def test_matmul_spans_several_tiles_and_k_steps():
    # M, N past one 64 tile, K past several 32 steps and not a multiple of them
    x, w = (
        _randn(70, 100, dtype=torch.float32, seed=5),
        _randn(130, 100, dtype=torch.float32, seed=6),
    )
    full = invariant_matmul(x, w)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    assert torch.equal(invariant_matmul(x[66:67], w)[0], full[66])
    assert invariant_matmul(x[:0], w).shape == (0, 130)


def test_matmul_gradients_are_a_linears():
    x = _randn(3, 20, dtype=torch.float32, seed=7).requires_grad_()
    w = _randn(9, 20, dtype=torch.float32, seed=8).requires_grad_()
    b = _randn(9, dtype=torch.float32, seed=9).requires_grad_()
    grad = _randn(3, 9, dtype=torch.float32, seed=10)
    InvariantLinear.apply(x, w, b).backward(grad)
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    torch.nn.functional.linear(x, w, b).backward(grad)
    for g, t in zip(got, (x, w, b)):
        torch.testing.assert_close(g, t.grad)


def test_matmul_rejects_mismatched_shapes_and_dtypes():
    with pytest.raises(ValueError, match="invariant_matmul"):
        invariant_matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="weight is torch.bfloat16"):
        invariant_matmul(torch.zeros(2, 3), torch.zeros(4, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_rows_take_the_same_bits_whatever_the_grouping(dtype):
    a, w = _randn(11, 70, dtype=dtype, seed=14), _randn(4, 90, 70, dtype=dtype, seed=15)
    ends = torch.tensor([3, 3, 8, 11], dtype=torch.int32)  # expert 1 has no rows
    out = expert_rows_linear(a, w, ends)
    experts = [0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 3]
    ref = torch.stack([a[i].double() @ w[e].double().T for i, e in enumerate(experts)])
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype] * 8, rtol=TOL[dtype])
    alone = expert_rows_linear(a[3:4], w, torch.tensor([0, 0, 1, 1], dtype=torch.int32))
    assert torch.equal(alone[0], out[3])
    assert torch.equal(expert_rows_linear(a[:5], w, ends.clamp(max=5)), out[:5])


# --- RMSNorm and log_softmax -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_is_the_same_at_any_row_count(dtype):
    x, w = _randn(17, 1500, dtype=dtype, seed=11), _randn(1500, dtype=dtype, seed=12)
    full = rms_norm(x, w, 1e-6)
    for i in (0, 7, 16):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-6)[0], full[i])
    assert torch.equal(rms_norm(x[:3], w, 1e-6), full[:3])
    ref = torch_rms_norm(x, w, 1e-6)
    assert full.dtype == ref.dtype
    torch.testing.assert_close(full.float(), ref.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_row_is_the_same_at_any_row_count(dtype):
    x = _randn(9, 2500, dtype=dtype, seed=13) * 4
    full = log_softmax(x)
    for i in (0, 4, 8):
        assert torch.equal(log_softmax(x[i : i + 1])[0], full[i])
    assert full.dtype == torch.float32
    ref = torch.log_softmax(x.double(), dim=-1)
    torch.testing.assert_close(full.double(), ref, atol=1e-5, rtol=1e-5)


# --- attention -------------------------------------------------------------------------------

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 24
LENGTHS = [13, 7, 20]  # each sequence's full length


class Sequences:
    """Each sequence's q, k, v at every position and its block table, fixed across steps."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.q = [
            _randn(n, HEADS, HEAD_DIM, dtype=dtype, seed=20 + i) for i, n in enumerate(LENGTHS)
        ]
        self.k = [
            _randn(n, KV_HEADS, HEAD_DIM, dtype=dtype, seed=30 + i) for i, n in enumerate(LENGTHS)
        ]
        self.v = [
            _randn(n, KV_HEADS, HEAD_DIM, dtype=dtype, seed=40 + i) for i, n in enumerate(LENGTHS)
        ]
        pool = torch.randperm(40, generator=torch.Generator().manual_seed(50)).tolist()
        self.tables = []
        for n in LENGTHS:
            used = -(-n // BLOCK_SIZE)
            self.tables.append(pool[:used])
            pool = pool[used:]

    def step(self, backend, chunks, window, sinks) -> dict[tuple[int, int], torch.Tensor]:
        """One step of (sequence, start, end) chunks, positions before `start` already cached
        (prefill chunks first, then one-token decodes) -> {(sequence, position): out [H, Dv]}."""
        chunks = sorted(chunks, key=lambda c: c[2] - c[1] == 1 and c[1] > 0)
        shape = (40 * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        v_cache = torch.full(shape, float("nan"), dtype=self.dtype)
        for s, start, _ in chunks:  # the context cached by earlier steps
            for pos in range(start):
                slot = self.tables[s][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                k_cache[slot], v_cache[slot] = self.k[s][pos], self.v[s][pos]
        slices = [SeqSlice(end - start, end, self.tables[s]) for s, start, end in chunks]
        decodes = [c for c in chunks if c[2] - c[1] == 1 and c[1] > 0]
        split = len(chunks) - len(decodes)
        meta = build_metadata(slices[:split], slices[split:], BLOCK_SIZE)
        cat = lambda xs: torch.cat([x[s][a:b] for s, a, b in chunks for x in [xs]])  # noqa: E731
        out = backend.forward(
            cat(self.q), cat(self.k), cat(self.v), k_cache, v_cache, meta, 0.37, window, sinks
        )
        rows = [(s, p) for s, a, b in chunks for p in range(a, b)]
        return dict(zip(rows, out))


# each scenario: steps of (sequence, start, end) chunks; together they cover every position
SCENARIOS = {
    "mixed": [[(0, 0, 13), (1, 0, 7), (2, 0, 20)]],
    "chunked": [
        [(0, 0, 5), (2, 0, 9)],
        [(0, 5, 12), (1, 0, 7), (2, 9, 19)],
        [(0, 12, 13), (2, 19, 20)],
    ],
    "decodes": [
        [(2, 0, 3), (0, 0, 1)],
        [(2, 3, 4), (0, 1, 8), (1, 0, 6)],
        [(2, 4, 20), (0, 8, 9), (1, 6, 7)],
        [(0, 9, 13)],
    ],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, True)])
def test_attention_row_is_the_same_alone_batched_and_split(dtype, window, with_sinks):
    seqs = Sequences(dtype)
    sinks = _randn(HEADS, dtype=torch.float32, seed=60) * 2 if with_sinks else None
    backend = TritonAttention(invariant=True)
    alone = {}
    for s, n in enumerate(LENGTHS):  # each sequence alone, one prefill chunk
        alone.update(seqs.step(backend, [(s, 0, n)], window, sinks))
        ref = seqs.step(TorchAttention(), [(s, 0, n)], window, sinks)
        for pos in range(n):
            torch.testing.assert_close(
                alone[s, pos].float(), ref[s, pos].float(), atol=TOL[dtype], rtol=TOL[dtype]
            )
    for name, steps in SCENARIOS.items():
        got = {}
        for chunks in steps:
            got.update(seqs.step(backend, chunks, window, sinks))
        assert sorted(got) == sorted(alone), name
        for key, row in got.items():
            assert torch.equal(row, alone[key]), f"{name}: sequence {key[0]} position {key[1]}"


def test_the_plain_triton_backend_still_splits_by_the_batch():
    # the invariant form is opt-in: the default keeps its prefill kernel and split-K decode
    assert not TritonAttention().invariant


# --- backend selection -----------------------------------------------------------------------


def test_the_mode_takes_the_invariant_triton_backend_on_cuda():
    cuda = torch.device("cuda")  # no GPU needed: the choice reads the device type
    assert (
        batch_invariant_backend("auto", cuda)
        == batch_invariant_backend("TRITON_ATTN", cuda)
        == "triton"
    )
    backend = get_backend(
        "triton", cuda, ("full", "sliding", "sinks"), BackendRequest(num_splits=1)
    )
    assert isinstance(backend, TritonAttention) and backend.invariant
    assert not get_backend("triton", cuda, ("full",), BackendRequest()).invariant
    with pytest.raises(ValueError, match="attention_backend.*not batch invariant.*'triton'"):
        batch_invariant_backend("cpu", cuda)
    with pytest.raises(ValueError, match="not on mps"):
        batch_invariant_backend("auto", torch.device("mps"))


def test_the_mode_refuses_cuda_without_triton(monkeypatch):
    import raylane.kernels.batch_invariant.backend as backend

    monkeypatch.setattr(backend, "has_triton", lambda device: False)
    with pytest.raises(ValueError, match="needs triton"):
        batch_invariant_backend("auto", torch.device("cuda"))
