"""Gated delta rule and causal conv1d references against transformers' own torch fallbacks
(Qwen3-Next's `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`, `causal_conv1d_update`), including state carried across chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.linear_attention.conv1d import causal_conv1d, causal_conv1d_update
from raylane.kernels.linear_attention.gated_delta import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from raylane.kernels.linear_attention.metadata import StateMetadata
from raylane.kernels.linear_attention.torch_ref import TorchLinearAttention
from transformers.models.qwen3_next import modeling_qwen3_next as hf

HK, HV, DK, DV, C, W = 2, 4, 16, 8, 24, 4  # grouped heads: 2 value heads per key head
TOL = 2e-5


def delta_inputs(length: int, gen: torch.Generator, batch: int = 1):
    q, k = (torch.randn(batch, length, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(batch, length, HV, generator=gen))  # log decay <= 0
    beta = torch.randn(batch, length, HV, generator=gen).sigmoid()
    return q, k, v, g, beta


def hf_delta(q, k, v, g, beta, state):
    """HF's token-by-token fallback: the independent ground truth, [B, L, ...]."""
    return hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip


@pytest.mark.parametrize("length,chunk", [(37, 16), (64, 64), (5, 64)])
def test_chunked_matches_hf(length: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(length)
    q, k, v, g, beta = delta_inputs(length, gen)
    s0 = torch.randn(1, HV, DK, DV, generator=gen)
    want, want_state = hf_delta(q, k, v, g, beta, s0)
    hf_chunk, hf_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, state = chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], s0[0], chunk)
    torch.testing.assert_close(out, want[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, want_state[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(out, hf_chunk[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, hf_state[0], atol=TOL, rtol=TOL)


def test_recurrent_matches_hf() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = delta_inputs(6, gen, batch=3)
    s0 = torch.randn(3, HV, DK, DV, generator=gen)
    want, want_state = hf_delta(q, k, v, g, beta, s0)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state, want_state, atol=TOL, rtol=TOL)


def test_bf16_inputs_keep_a_float32_state() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = (x.bfloat16() for x in delta_inputs(20, gen))
    s0 = torch.zeros(HV, DK, DV)
    out, state = chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], s0, 8)
    want, want_state = hf_delta(q, k, v, g, beta, s0[None])
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(state, want_state[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(out.float(), want[0].float(), atol=1e-2, rtol=1e-2)


def conv_weights(gen: torch.Generator):
    return torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)


def hf_conv(x: torch.Tensor, weight, bias) -> torch.Tensor:
    """HF's whole-sequence conv (zero history): [L, C] -> [L, C]."""
    return hf.causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T


def test_conv_chunks_with_state_match_one_pass() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, bias = conv_weights(gen)
    x = torch.randn(30, C, generator=gen)
    want = hf_conv(x, weight, bias)
    state = torch.full((3, C, W - 1), float("nan"))
    state[2] = 0  # the runner zeroes a new sequence's slot
    got = [causal_conv1d(x[a:b], weight, bias, state, [0, b - a], [2]) for a, b in
           [(0, 2), (2, 13), (13, 27)]]  # fmt: skip
    for t in range(27, 30):  # then decode steps through the update path
        got.append(causal_conv1d_update(x[t : t + 1], weight, bias, state, torch.tensor([2])))
    torch.testing.assert_close(torch.cat(got), want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state[2], x[-(W - 1) :].T)
    assert state[:2].isnan().all()  # other slots untouched


def test_conv_update_matches_hf() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, bias = conv_weights(gen)
    x = torch.randn(3, C, generator=gen)
    state = torch.randn(5, C, W - 1, generator=gen)
    hf_state = state[[4, 0, 2]].clone()
    want = hf.causal_conv1d_update(x[:, :, None], hf_state, weight, bias, "silu")[:, :, 0]
    got = causal_conv1d_update(x, weight, bias, state, torch.tensor([4, 0, 2]))
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(state[[4, 0, 2]], hf_state)


def test_mixed_step_carries_state_across_chunks() -> None:
    """Two sequences through the backend: a prefill cut into chunks (one step mixing a chunk of
    one with decodes of the other) equals HF's one pass over each whole sequence."""
    gen = torch.Generator().manual_seed(5)
    lens = {0: 41, 1: 9}
    inputs = {i: [x[0] for x in delta_inputs(n, gen)] for i, n in lens.items()}
    xs = {i: torch.randn(n, C, generator=gen) for i, n in lens.items()}
    weight, bias = conv_weights(gen)
    backend = TorchLinearAttention(chunk_size=8)
    state = torch.zeros(4, HV, DK, DV)
    conv_state = torch.zeros(4, C, W - 1)
    slot = {0: 3, 1: 1}
    # each step: (seq, start, end) with prefills first; decodes are single tokens
    steps = [[(0, 0, 17), (1, 0, 7)], [(0, 17, 30), (1, 7, 8)], [(0, 30, 41), (1, 8, 9)]]
    outs = {i: [] for i in lens}
    conv_outs = {i: [] for i in lens}
    for step in steps:
        qsl = [0]
        for _, a, b in step:
            qsl.append(qsl[-1] + b - a)
        n_pre = sum(1 for _, a, b in step if b - a > 1 or a == 0)
        slots = [slot[i] for i, _, _ in step]
        meta = StateMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            state_slots=torch.tensor(slots),
            num_prefills=n_pre,
            num_prefill_tokens=qsl[n_pre],
            max_query_len=max(b - a for _, a, b in step),
            query_start_loc_host=qsl,
            state_slots_host=slots,
        )
        cat = [torch.cat([inputs[i][j][a:b] for i, a, b in step]) for j in range(5)]
        o = backend.delta_rule(*cat, state, meta)
        co = backend.conv(
            torch.cat([xs[i][a:b] for i, a, b in step]), weight, bias, conv_state, meta
        )
        for n, (i, a, b) in enumerate(step):
            outs[i].append(o[qsl[n] : qsl[n + 1]])
            conv_outs[i].append(co[qsl[n] : qsl[n + 1]])
    for i in lens:
        want, want_state = hf_delta(*(x[None] for x in inputs[i]), None)
        torch.testing.assert_close(torch.cat(outs[i]), want[0], atol=TOL, rtol=TOL)
        torch.testing.assert_close(state[slot[i]], want_state[0], atol=TOL, rtol=TOL)
        torch.testing.assert_close(
            torch.cat(conv_outs[i]), hf_conv(xs[i], weight, bias), atol=TOL, rtol=TOL
        )


def test_registry_picks_the_reference_on_cpu() -> None:
    from raylane.kernels.linear_attention import get_linear_backend

    assert get_linear_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="linear_attention_backend"):
        get_linear_backend("triton", "cpu")
