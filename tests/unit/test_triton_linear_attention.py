"""Triton linear-attention kernels (under the CPU interpreter) against the torch reference on a
mixed step: prefill chunks with carried state, then decodes, in NaN-poisoned slot pools."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from raylane.kernels.linear_attention.metadata import StateMetadata  # noqa: E402
from raylane.kernels.linear_attention.torch_ref import TorchLinearAttention  # noqa: E402
from raylane.kernels.linear_attention.triton_backend import TritonLinearAttention  # noqa: E402

HK, HV, DK, DV, C, W = 1, 2, 16, 24, 40, 4
LENS = [9, 2, 1, 1]  # two prefill chunks (one shorter than the conv's history), two decodes
SLOTS = [4, 0, 2, 5]


def step_meta(
    lens: list[int] = LENS, slots: list[int] = SLOTS, num_prefills: int = 2, verify=None
) -> StateMetadata:
    """A step's rows of `lens` tokens in `slots`, the first `num_prefills` run as chunks."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return StateMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        state_slots=torch.tensor(slots),
        num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills],
        max_query_len=max(lens),
        query_start_loc_host=qsl,
        state_slots_host=slots,
        verify=verify,
    )


def pools(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    pool = torch.full((7, *shape), float("nan"))  # slots nobody owns stay NaN
    pool[SLOTS] = torch.randn(len(SLOTS), *shape, generator=gen)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t = sum(LENS)
    q, k = (torch.randn(t, HK, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(t, HV, generator=gen)).to(dtype)
    beta = torch.randn(t, HV, generator=gen).sigmoid().to(dtype)
    state = pools((HV, DK, DV), gen)
    want_state = state.clone()
    want = TorchLinearAttention(chunk_size=4).delta_rule(q, k, v, g, beta, want_state, step_meta())
    got = TritonLinearAttention().delta_rule(q, k, v, g, beta, state, step_meta())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_reference(bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(LENS), C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    b = torch.randn(C, generator=gen) if bias else None
    conv_state = pools((C, W - 1), gen)
    want_state = conv_state.clone()
    want = TorchLinearAttention().conv(x, weight, b, want_state, step_meta())
    got = TritonLinearAttention().conv(x, weight, b, conv_state, step_meta())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_state, want_state, equal_nan=True)
