"""Fused elementwise ops of a decoder layer (RMSNorm with its residual add, gated activation,
rotate-half RoPE), from a registry: one implementation is chosen at start-up for the model's
device, never by checks in model code.

- "torch": the eager reference ops (kernels/norm.py, kernels/activation.py); any device.
- "cpu": csrc/elementwise.c through ctypes, one pass per row and no temporaries, on float32 and
  bfloat16 rows with a contiguous last dim; other calls (float16, odd layouts, activations
  other than SiLU) take the torch ops. Matches them within float32 rounding (sum order,
  the SiLU exp polynomial); RoPE bit for bit (each product and the sum rounded on its own).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from raylane.kernels.activation import act_and_mul
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.elementwise import silu_and_mul
from raylane.kernels.cpu_build import DTYPES, load_library
from raylane.kernels.norm import add_offset_rms_norm, add_rms_norm
from raylane.kernels.rotary import apply_rotary

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "elementwise.c"
_C_DTYPES = (torch.float32, torch.bfloat16)
_C_ACTS = ("silu", "swish")


class FusedOps(Protocol):
    name: str

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        weight_first: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> norm(x); with `residual`: (norm(x + residual), x + residual).
        `weight_first`: the weight applied in float32 before the cast back (kernels/norm.py)."""
        ...

    def offset_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Gemma's (1 + w) norm (kernels/norm.py's GemmaRMSNorm), as rms_norm returns."""
        ...

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """x [T, 2 * I] laid out [gate | up] -> act(gate) * up, [T, I]."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by cos/sin [T, R] (kernels/rotary.py's `apply_rotary`)."""
        ...


class TorchOps:
    name = "torch"

    def rms_norm(self, x, weight, eps, residual, weight_first=False):
        return add_rms_norm(x, weight, eps, residual, weight_first)

    def offset_rms_norm(self, x, weight, eps, residual):
        return add_offset_rms_norm(x, weight, eps, residual)  # torch's, whatever the ops

    def act_and_mul(self, x, act):
        return act_and_mul(x, act)

    def rotary(self, x, cos, sin):
        return apply_rotary(x, cos, sin)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm, self._act = lib.raylane_rms_norm, lib.raylane_silu_and_mul
        self._rotary = lib.raylane_rotary

    def rms_norm(self, x, weight, eps, residual, weight_first=False):
        d = x.shape[-1]
        if not (_c_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()) or (
            residual is not None and not (_c_ok(residual) and residual.shape == x.shape)
        ):
            return super().rms_norm(x, weight, eps, residual, weight_first)
        x, residual = _as_rows(x), None if residual is None else _as_rows(residual)
        x2 = x.view(-1, d) if x.dim() != 2 else x
        out = torch.empty(x.shape, dtype=x.dtype)
        res_out, res_ptr, res_stride = None, None, 0
        if residual is not None:
            res_out = torch.empty(x.shape, dtype=x.dtype)
            r2 = residual.view(-1, d) if residual.dim() != 2 else residual
            res_ptr, res_stride = r2.data_ptr(), r2.stride(0)
        rows = x2.shape[0]
        self._norm(
            x2.data_ptr(), x2.stride(0), res_ptr, res_stride,
            None if res_out is None else res_out.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, d, eps, int(weight_first), DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out if res_out is None else (out, res_out)

    def act_and_mul(self, x, act):
        if act not in _C_ACTS or not _c_ok(x):
            return super().act_and_mul(x, act)
        x = _as_rows(x)
        x2 = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
        inter = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype)
        self._act(
            x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], inter,
            DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotary(self, x, cos, sin):
        t, h, d = x.shape
        r = cos.shape[-1]  # < d: partial rotary (the leading r dims of each head)
        # odd widths and cos/sin in another dtype (torch would promote the result) are a
        # model's constants: the torch ops, always
        same = cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (t, r)
        if not (_c_ok(x) and same and r % 2 == 0 and 2 <= r <= d):
            return super().rotary(x, cos, sin)
        if x.stride(2) != 1 or x.stride(1) != d:  # heads not D apart in a row: copied
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty((t, h, d), dtype=x.dtype)
        self._rotary(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            t, h, d, r, DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out


def _c_ok(t: torch.Tensor) -> bool:
    """A tensor the C code computes: a supported dtype on the CPU, not empty, no autograd (the
    C ops have no backward). The choice must not depend on the layout or the number of rows: a
    layout-based fallback to the torch ops (a [T, H, D] view is contiguous only at T = 1) would
    round a sequence's values differently with the batch it shares a step with."""
    return (
        t.dtype in _C_DTYPES
        and t.is_cpu
        and not (t.requires_grad and torch.is_grad_enabled())
        and t.numel() > 0
    )


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where the C code can read it as [rows, D] (2-D with D contiguous, or
    contiguous), else a contiguous copy."""
    if t.is_contiguous() or (t.dim() == 2 and t.stride(1) == 1):
        return t
    return t.contiguous()


@functools.cache
def _cpu_library() -> ctypes.CDLL | None:
    try:
        lib = load_library(_SOURCE)
    except Exception as e:  # never raises: whatever broke, say so and use the torch ops
        logger.warning("CPU elementwise kernels unavailable: %s", e)
        return None
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    # x, x_stride, residual, res_stride, res_out, weight, out, rows, d, eps, weight_first,
    # dtype, threads
    lib.raylane_rms_norm.argtypes = [
        ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32, i32, i32
    ]  # fmt: skip
    lib.raylane_silu_and_mul.argtypes = [ptr, i64, ptr, i64, i64, i32, i32]
    # x, x_stride, cos, sin, out, rows, heads, d, rotary dims, dtype, threads
    lib.raylane_rotary.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.raylane_rms_norm.restype = lib.raylane_silu_and_mul.restype = ctypes.c_int
    lib.raylane_rotary.restype = ctypes.c_int
    return lib


def _has_cpu_kernels(device: torch.device) -> bool:
    return device.type == "cpu" and _cpu_library() is not None


def _cpu_ops() -> FusedOps:
    lib = _cpu_library()
    if lib is None:
        raise RuntimeError("the CPU elementwise kernels did not build (see the warning above)")
    return CpuOps(lib)


class InvariantOps(TorchOps):
    """The batch-invariant mode's: transformers' torch ops (what a trainer's forward runs), the
    gated activation row by row on the vector path (kernels/batch_invariant/elementwise.py).
    On CUDA, RMSNorm runs a Triton kernel of one order per row: torch's CUDA reduction sizes
    its blocks by the row count (kernels/batch_invariant/triton_rowwise.py)."""

    name = "batch_invariant"

    def rms_norm(self, x, weight, eps, residual, weight_first=False):
        if not on_triton(x.device):
            return super().rms_norm(x, weight, eps, residual, weight_first)
        from raylane.kernels.batch_invariant.triton_rowwise import rms_norm

        if residual is not None:
            x = residual + x  # in the model dtype, as add_rms_norm's (HF's residual add)
        out = rms_norm(x, weight, eps, weight_first)
        return out if residual is None else (out, x)

    def offset_rms_norm(self, x, weight, eps, residual):
        if not on_triton(x.device):
            return super().offset_rms_norm(x, weight, eps, residual)
        from raylane.kernels.batch_invariant.triton_gdn_norms import offset_rms_norm

        if residual is not None:
            x = residual + x
        out = offset_rms_norm(x, weight, eps)
        return out if residual is None else (out, x)

    def act_and_mul(self, x, act):
        return silu_and_mul(x, act)


# name -> (is_available, factory), in order of preference for "auto"
_OPS: dict[str, tuple[Callable[[torch.device], bool], Callable[[], FusedOps]]] = {
    "cpu": (_has_cpu_kernels, _cpu_ops),
    "torch": (lambda device: True, TorchOps),
    "batch_invariant": (lambda device: True, InvariantOps),  # never "auto"'s: torch comes first
}


def get_fused_ops(name: str = "auto", device: torch.device | str = "cpu") -> FusedOps:
    """The named implementation, or with "auto" the first available on `device`."""
    device = torch.device(device)
    names = [n for n, (ok, _) in _OPS.items() if ok(device)]
    if name == "auto":
        name = names[0]
    if name not in names:
        raise ValueError(f"fused ops {name!r} not available on {device}; available: {names}")
    return _OPS[name][1]()


def attach_fused_ops(model: torch.nn.Module, ops: FusedOps) -> None:
    """Hand `ops` to every RMSNorm, gated activation and RoPE of `model` (once, at start-up)."""
    from raylane.kernels.activation import SiluAndMul
    from raylane.kernels.norm import RMSNorm
    from raylane.kernels.rotary import Rotary

    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, Rotary)):
            module.ops = ops
