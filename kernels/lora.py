"""Multi-LoRA's per-layer add on the CPU (csrc/lora.c through ctypes): y[t] += x[t] @ A_s^T @
B_s^T for each adapter token t on its slot s, reading the step's token -> slot list directly
(no gather, scatter or temporaries). The low-rank math runs in float32 (float32 copies of the
weights, bfloat16 rows read as float32), each output rounded once; a token's result depends on
its own row only.

`LoRAKernelWeights` holds one layer's weights in the kernel's layout, `LoRATokens` one step's
adapter tokens sorted by slot; `lora_kernel()` is None where the C code did not build (the
callers then keep their torch path).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from raylane.kernels.cpu_build import DTYPES, load_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "lora.c"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of x and y; the weights are float32
VEC = 16  # csrc/lora.c's: floats per vector, the padding of its layout


class LoRATokens:
    """One step's adapter tokens, sorted by slot (stable: in token order within a slot):
    `tokens` [n] int32 their rows in x, `slots` [n] int32 their slot indices."""

    def __init__(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        self.tokens = torch.tensor(tokens, dtype=torch.int32)
        self.slots = torch.tensor(slots, dtype=torch.int32)
        self.args = (self.tokens.data_ptr(), self.slots.data_ptr(), len(tokens))


class LoRAKernelWeights:
    """One layer's slots in the kernel's layout, float32, VEC floats to a vector (csrc/lora.c):
    `at` [S, in, WP] (A transposed, the parts side by side, WP = P * R rounded up to VEC),
    `bt` [S, R, OUTP] (each output column's own part's ranks only, each part's columns padded
    to a multiple of VEC). Padding is zero. `part_ends`: where each part's columns end in y."""

    def __init__(self, slots: int, rank: int, in_features: int, part_ends: Sequence[int]) -> None:
        self.rank, self.part_ends = rank, list(part_ends)
        begins = [0, *self.part_ends[:-1]]
        # each part's (columns in y, their first column in bt)
        self._parts: list[tuple[slice, int]] = []
        padded = 0
        for begin, end in zip(begins, self.part_ends):
            self._parts.append((slice(begin, end), padded))
            padded += _round_up(end - begin)
        self.at = torch.zeros(slots, in_features, _round_up(len(self.part_ends) * rank))
        self.bt = torch.zeros(slots, rank, padded)
        self._ends = torch.tensor(self.part_ends, dtype=torch.int64)
        self.args = (
            self.at.data_ptr(), self.bt.data_ptr(), in_features, rank,
            self._ends.data_ptr(), len(self.part_ends),
        )  # fmt: skip

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [P * R, in], b [out, P * R] (LayerLoRA's buffers of one slot) -> this layout."""
        self.at[slot, :, : a.shape[0]].copy_(a.t())
        for part, (columns, first) in enumerate(self._parts):
            ranks = slice(part * self.rank, (part + 1) * self.rank)
            width = columns.stop - columns.start
            self.bt[slot, :, first : first + width].copy_(b[columns, ranks].t())


def _round_up(n: int) -> int:
    return -(-n // VEC) * VEC


class LoRAKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._add = lib.raylane_lora_add

    def add(
        self, x: torch.Tensor, y: torch.Tensor, tokens: LoRATokens, weights: LoRAKernelWeights
    ) -> None:
        """y [T, out] += each listed token's delta of x [T, in], in place. x and y: CPU, a
        KERNEL_DTYPES dtype (both the same), rows with a contiguous last dim."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        status = self._add(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), DTYPES[x.dtype],
            *tokens.args, *weights.args, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("raylane_lora_add: out of memory")

    @staticmethod
    def takes(x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether `add` computes x and y (else the caller's torch path does)."""
        return (
            x.is_cpu
            and x.dtype in KERNEL_DTYPES
            and y.dtype == x.dtype
            and x.dim() == 2
            and y.dim() == 2
            and y.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad))
        )


@functools.cache
def lora_kernel() -> LoRAKernel | None:
    """The C kernel, or None (with a warning) where it did not build."""
    try:
        lib = load_library(_SOURCE)
    except Exception as e:  # never raises: the torch path serves instead
        logger.warning("CPU LoRA kernel unavailable: %s", e)
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    # x, x_stride, y, y_stride, dtype, tokens, slots, n, at, bt, in, rank, part_ends, parts,
    # threads
    lib.raylane_lora_add.argtypes = [
        ptr, i64, ptr, i64, i32, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i64, i32,
    ]  # fmt: skip
    lib.raylane_lora_add.restype = ctypes.c_int
    return LoRAKernel(lib)
