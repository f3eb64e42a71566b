"""Paged attention (build_metadata + TorchAttention) against naive per-sequence causal attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from raylane.kernels.attention import get_backend
from raylane.kernels.attention.builder import SeqSlice, build_metadata
from raylane.kernels.attention.torch_ref import TorchAttention

torch.set_num_threads(1)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = 0.37


@dataclass
class SeqData:
    num_new: int
    context_len: int
    block_table: list[int]
    k: torch.Tensor  # [context_len, KV_HEADS, HEAD_DIM] the whole context's keys
    v: torch.Tensor
    q: torch.Tensor  # [num_new, HEADS, HEAD_DIM] queries of the new tokens

    def slot(self, pos: int, block_size: int) -> int:
        return self.block_table[pos // block_size] * block_size + pos % block_size


def make_seqs(shapes: list[tuple[int, int]], block_size: int, gen: torch.Generator):
    """Random data and random, non-contiguous block tables for (num_new, context_len) pairs."""
    need = [-(-ctx // block_size) for _, ctx in shapes]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for (num_new, ctx), n in zip(shapes, need):
        table, pool = pool[:n], pool[n:]
        seqs.append(
            SeqData(
                num_new,
                ctx,
                table,
                *(torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2)),
                torch.randn(num_new, HEADS, HEAD_DIM, generator=gen),
            )
        )
    return seqs, num_blocks


def naive_attention(s: SeqData, window: int | None = None, sinks=None) -> torch.Tensor:
    """softmax(q k^T * scale) v for each new query over positions <= its own, head by head;
    with `window` only the last `window` positions; with `sinks` [H] exp(sink) joins each
    denominator."""
    q, k, v = (t.double() for t in (s.q, s.k, s.v))
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for i in range(s.num_new):
        pos = s.context_len - s.num_new + i
        for h in range(HEADS):
            kv = h // group  # GQA: consecutive query heads share a KV head
            first = 0 if window is None else max(0, pos - window + 1)
            keys = range(first, pos + 1)
            scores = [float(q[i, h] @ k[j, kv]) * SCALE for j in keys]
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            total = sum(weights) + (0.0 if sinks is None else math.exp(float(sinks[h]) - top))
            out[i, h] = sum(w / total * v[j, kv] for j, w in zip(keys, weights))
    return out


def run_backend(
    prefills,
    decodes,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    backend=None,
    **opts,
):
    gen = torch.Generator().manual_seed(seed)
    seqs, num_blocks = make_seqs(prefills + decodes, block_size, gen)
    for s in seqs:  # round the data to `dtype`; the naive reference then runs on the same values
        s.q, s.k, s.v = (t.to(dtype) for t in (s.q, s.k, s.v))
    slots = num_blocks * block_size
    # garbage where unwritten
    k_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    for s in seqs:  # the context computed in earlier steps is already in the cache
        for pos in range(s.context_len - s.num_new):
            k_cache[s.slot(pos, block_size)] = s.k[pos]
            v_cache[s.slot(pos, block_size)] = s.v[pos]
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.context_len - s.num_new :] for s in seqs])
    v = torch.cat([s.v[s.context_len - s.num_new :] for s in seqs])
    slices = [SeqSlice(s.num_new, s.context_len, s.block_table) for s in seqs]
    meta = build_metadata(slices[: len(prefills)], slices[len(prefills) :], block_size)
    out = (backend or TorchAttention()).forward(q, k, v, k_cache, v_cache, meta, SCALE, **opts)
    return seqs, out, k_cache, v_cache


CASES = {
    "fresh_prefill": ([(7, 7)], []),
    "chunk_over_cached_context": ([(5, 21)], []),
    "single_token_chunk": ([(1, 6)], []),
    "decodes": ([], [(1, 1), (1, 9), (1, 16), (1, 33)]),
    "mixed": ([(7, 7), (5, 21), (2, 4)], [(1, 3), (1, 20), (1, 17)]),
    # short and long contexts in one decode batch: the short ones are masked past their end
    "split_decodes": (
        [(3, 9)],
        [(1, 2 + i) for i in range(10)] + [(1, 60 + 3 * i) for i in range(10)],
    ),
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive_causal_attention(case, block_size):
    prefills, decodes = CASES[case]
    seqs, out, _, _ = run_backend(prefills, decodes, block_size, seed=len(case) + block_size)
    assert out.shape == (sum(s.num_new for s in seqs), HEADS, HEAD_DIM)
    start = 0
    for s in seqs:  # flat rows: prefill chunks first, then decodes, in the order given
        torch.testing.assert_close(
            out[start : start + s.num_new].double(), naive_attention(s), atol=1e-5, rtol=1e-5
        )
        start += s.num_new


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sliding_window_and_sinks_match_naive(window, with_sinks):
    """Prefill chunks (fresh and over cached context) and decodes longer than the window."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    opts = {"window": window, "sinks": sinks}
    for block_size in (4, 16):
        seqs, out, _, _ = run_backend(*CASES["mixed"], block_size, seed=block_size, **opts)
        want = torch.cat([naive_attention(s, window, sinks) for s in seqs])
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.bfloat16, 3e-2)])
def test_matches_naive_attention_in_other_dtypes(dtype, tol):
    prefills, decodes = CASES["mixed"]
    seqs, out, _, _ = run_backend(prefills, decodes, block_size=4, seed=3, dtype=dtype)
    assert out.dtype == dtype
    want = torch.cat([naive_attention(s) for s in seqs])
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [4, 16])
def test_new_keys_and_values_are_written_to_their_slots(block_size):
    prefills, decodes = CASES["mixed"]
    seqs, _, k_cache, v_cache = run_backend(prefills, decodes, block_size, seed=5)
    for s in seqs:
        for pos in range(s.context_len):
            slot = s.slot(pos, block_size)
            torch.testing.assert_close(k_cache[slot], s.k[pos], atol=0, rtol=0)
            torch.testing.assert_close(v_cache[slot], s.v[pos], atol=0, rtol=0)


def test_slot_mapping_follows_the_block_table():
    slices = [SeqSlice(3, 7, [5, 2]), SeqSlice(1, 9, [0, 7, 3])]
    meta = build_metadata(slices[:1], slices[1:], block_size=4)
    # positions 4,5,6 of seq 0 live in block 2; position 8 of seq 1 in block 3
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 3 * 4 + 0]
    assert meta.num_tokens == 4


def test_registry_prefers_the_c_kernel_on_cpu_and_knows_the_torch_reference():
    from raylane.kernels.attention import cpu_kernel

    want = "cpu" if cpu_kernel.is_available() else "torch"
    assert get_backend("auto", "cpu").name == want
    assert get_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("no-such-backend", "cpu")
    with pytest.raises(ValueError, match="not available on cpu"):
        get_backend("triton", "cpu")  # a GPU backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_equals_the_torch_reference_on_a_step(dtype):
    """The C kernel behind the backend API, fed the same metadata and cache as the reference."""
    from raylane.kernels.attention import cpu_kernel

    if not cpu_kernel.is_available():
        pytest.skip("no C compiler: the CPU kernel is not built")
    prefills, decodes = CASES["mixed"]
    ref_seqs, ref, ref_k, _ = run_backend(prefills, decodes, 4, seed=9, dtype=dtype)
    got_seqs, got, got_k, _ = run_backend(
        prefills, decodes, 4, seed=9, dtype=dtype, backend=get_backend("cpu", "cpu")
    )
    torch.testing.assert_close(got_k, ref_k, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: output rounding, one ulp apart
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
