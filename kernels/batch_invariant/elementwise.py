"""Row-invariant elementwise ops for narrow rows (a router's [T, E] scores).

torch's CPU elementwise loops run a tensor's elements in vectors of 2 * Vec::size() and the
rest one by one, and for transcendental ops (sigmoid, exp) the two paths round differently.
A row of E elements then takes one path or the other by where it sits in the flattened tensor
(measured: a [1, 8] sigmoid is scalar, its row inside [4, 8] vectorised, 1 ulp apart). Padding
each row to a multiple of PAD_COLUMNS puts every row on the vector path, and calls of at most
MAX_ELEMENTS stay under torch's parallel grain, so no thread split moves the vectors either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

PAD_COLUMNS = 64  # two 512-bit vectors of float32 (and four of bfloat16)
MAX_ELEMENTS = 32768  # torch's internal GRAIN_SIZE: smaller calls run on one thread


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn` over x [T, E], each row computed the same way whatever T."""
    width = x.shape[1]
    padded = F.pad(x, (0, -width % PAD_COLUMNS))  # [T, E'], E' a multiple of PAD_COLUMNS
    step = max(1, MAX_ELEMENTS // padded.shape[1])
    parts = [fn(padded[i : i + step]) for i in range(0, padded.shape[0], step)]
    out = torch.cat(parts) if parts else fn(padded)
    return out[:, :width]
