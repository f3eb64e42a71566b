"""Multi-LoRA's per-layer add on the CPU (csrc/lora.c through ctypes): y[t] += x[t] @ A_s^T @
B_s^T for each adapter token t on its slot s, reading the step's token -> slot list directly
(no gather, scatter or temporaries). The weights are copies in the kernel's layout in the
model dtype; the low-rank math runs in float32 (bfloat16 values widened exactly), each output
rounded once; a token's result depends on its own row only.

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
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of x, y and the weights (all one dtype)
VEC, TILE = 16, 32  # csrc/lora.c's: floats per vector (the padding), columns per tile


class LoRATokens:
    """One step's adapter tokens, sorted by slot (stable: in token order within a slot):
    `tokens` [n] int32 their rows in x, `slots` [n] int32 their slot indices."""

    def __init__(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        self.tokens = torch.tensor(tokens, dtype=torch.int32)
        self.slots = torch.tensor(slots, dtype=torch.int32)
        self.args = (self.tokens.data_ptr(), self.slots.data_ptr(), len(tokens))


class LoRAKernelWeights:
    """One layer's slots in the kernel's layout (csrc/lora.c), in the model dtype:
    A^T [in, WP] (the parts' ranks side by side, WP = P * R rounded up to VEC) and B^T
    [R, OUTP] (each output column's own part's ranks only, each part's columns padded to a
    multiple of VEC), each cut into tiles of up to TILE columns stored one after another
    (a tile of w columns from column c: [rows, w] at c * rows), so a tile's weights stream in
    one run. Padding is zero. `part_ends`: where each part's columns end in y."""

    def __init__(
        self, slots: int, rank: int, in_features: int, part_ends: Sequence[int], dtype: torch.dtype
    ) -> None:
        self.rank, self.in_features, self.part_ends = rank, in_features, list(part_ends)
        self.width = _round_up(len(self.part_ends) * rank)
        # each part's columns in y, and B^T's tiles (first padded column, width)
        self._columns: list[slice] = []
        self._b_tiles: list[tuple[int, int]] = []
        padded = 0
        for begin, end in zip([0, *self.part_ends[:-1]], self.part_ends):
            self._columns.append(slice(begin, end))
            self._b_tiles += _tiles(padded, _round_up(end - begin))
            padded += _round_up(end - begin)
        self.out_padded = padded
        self.at = torch.zeros(slots, in_features * self.width, dtype=dtype)
        self.bt = torch.zeros(slots, rank * padded, dtype=dtype)
        self._ends = torch.tensor(self.part_ends, dtype=torch.int64)
        self.args = (
            self.at.data_ptr(), self.bt.data_ptr(), DTYPES[dtype], in_features, rank,
            self._ends.data_ptr(), len(self.part_ends),
        )  # fmt: skip

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [P * R, in], b [out, P * R] (LayerLoRA's buffers of one slot) -> this layout."""
        a_t = a.new_zeros(self.in_features, self.width)
        a_t[:, : a.shape[0]] = a.t()
        b_t = b.new_zeros(self.rank, self.out_padded)
        first = 0
        for part, columns in enumerate(self._columns):
            ranks = slice(part * self.rank, (part + 1) * self.rank)
            b_t[:, first : first + columns.stop - columns.start] = b[columns, ranks].t()
            first += _round_up(columns.stop - columns.start)
        _store_tiles(self.at[slot], a_t, _tiles(0, self.width))
        _store_tiles(self.bt[slot], b_t, self._b_tiles)


def _round_up(n: int) -> int:
    return -(-n // VEC) * VEC


def _tiles(first: int, columns: int) -> list[tuple[int, int]]:
    """(first column, width) of the tiles over `columns` columns from `first`."""
    return [(first + c, min(TILE, columns - c)) for c in range(0, columns, TILE)]


def _store_tiles(flat: torch.Tensor, full: torch.Tensor, tiles: list[tuple[int, int]]) -> None:
    """full [rows, cols] into `flat` tile by tile: columns [c, c + w) as [rows, w] at c * rows."""
    rows = full.shape[0]
    for c, w in tiles:
        flat[c * rows : (c + w) * rows].view(rows, w).copy_(full[:, c : c + w])


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
    # x, x_stride, y, y_stride, dtype, tokens, slots, n, at, bt, weight dtype, in, rank,
    # part_ends, parts, threads
    lib.raylane_lora_add.argtypes = [
        ptr, i64, ptr, i64, i32, ptr, ptr, i64, ptr, ptr, i32, i64, i64, ptr, i64, i32,
    ]  # fmt: skip
    lib.raylane_lora_add.restype = ctypes.c_int
    return LoRAKernel(lib)
