"""The Gated DeltaNet hybrids' RMSNorms on the batch-invariant mode's CUDA path
(kernels/batch_invariant/triton_gdn_norms.py: the (1 + w) norm and the gated norm, which the
engine's modules and a trainer's transformers classes share), under Triton's CPU interpreter
with that path forced onto CPU tensors: a row alone equals the row in a batch (==), close to
transformers' own torch-op forwards and their gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_batch_invariant_triton_families import DTYPES, TOL, _randn, triton_path

pytest.importorskip("triton")
__all__ = ["triton_path"]  # the fixture, used by name


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_hybrids_norms_give_a_row_its_bits_and_transformers_numerics(triton_path, dtype):
    from raylane.kernels.batch_invariant import triton_gdn_norms as norms
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x, gate = _randn(17, 24, seed=70, dtype=dtype), _randn(17, 24, seed=71, dtype=dtype)
    offset, gated = hf.Qwen3_5RMSNorm(24, eps=1e-6), hf.Qwen3_5RMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        offset.weight.copy_(_randn(24, seed=72) / 4)
        gated.weight.copy_(_randn(24, seed=73))
    offset, gated = offset.to(dtype), gated.to(dtype)
    ours = {
        "offset": lambda rows, g: norms.offset_norm(type(offset).forward)(offset, rows),
        "gated": lambda rows, g: norms.gated_norm(type(gated).forward)(gated, rows, g),
    }
    for name, op in ours.items():
        full = op(x, gate)
        for i in (0, 9, 16):  # a row alone: the same bits
            assert torch.equal(op(x[i : i + 1], gate[i : i + 1])[0], full[i]), (name, i)
        want = offset(x) if name == "offset" else gated(x, gate)  # transformers' torch ops
        torch.testing.assert_close(full.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_the_hybrids_norms_have_transformers_gradients(triton_path):
    from raylane.kernels.batch_invariant.triton_gdn_norms import gated_rms_norm, offset_rms_norm

    x, gate = (_randn(5, 16, seed=s).requires_grad_() for s in (80, 81))
    w = _randn(16, seed=82).requires_grad_()
    mix = _randn(5, 16, seed=83)
    got = torch.autograd.grad(
        ((offset_rms_norm(x, w, 1e-6) + gated_rms_norm(x, gate, w, 1e-6)) * mix).sum(), (x, gate, w)
    )
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = torch.autograd.grad(
        ((xf * (1 + w) + w * xf * torch.nn.functional.silu(gate)) * mix).sum(), (x, gate, w)
    )
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
