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


# torch's own: `raylane.batch_invariant()` swaps these for `silu`, `sigmoid`, ... below
_SILU = F.silu
_SIGMOID = torch.sigmoid
_GELU = F.gelu
_SOFTPLUS = F.softplus


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x), each row of the last dim computed the same way whatever the rows
    around it (a router's [T, E] scores: the engine's mode runs `rowwise` on them)."""
    if x.dim() == 0:
        return _SIGMOID(x)
    return _by_rows(_SIGMOID, x)


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """F.silu(x), each row of the last dim computed on the vector path whatever the rows
    around it (a [T, I] call splits across threads, and leaves a scalar tail, at offsets that
    follow T * I). `inplace` is accepted for F.silu's signature and ignored."""
    return _by_rows(_SILU, x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu(x, approximate), row by row as `silu`."""
    return _by_rows(lambda t: _GELU(t, approximate=approximate), x)


def softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    """F.softplus(x, beta, threshold), row by row as `silu` (Gated DeltaNet's decay: the
    engine's mode runs `rowwise` on it)."""
    return _by_rows(lambda t: _SOFTPLUS(t, beta, threshold), x)


def _by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return rowwise(fn, x.reshape(-1, x.shape[-1])).reshape(x.shape)


# hidden_act -> its elementwise op (kernels/activation.py's); GELU's vector and scalar paths
# round apart as SiLU's do
_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _SILU,
    "swish": _SILU,
    "gelu": _GELU,
    "gelu_pytorch_tanh": lambda x: _GELU(x, approximate="tanh"),
}


def silu_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """x [T, 2 * I] laid out [gate | up] -> act(gate) * up, row-invariant (the batch-invariant
    mode's gated activation: SiLU, or GELU exact or tanh-approximated)."""
    if act not in _GATES:
        raise ValueError(
            f"hidden_act: {act!r} has no batch-invariant path (only {sorted(_GATES)}); turn "
            "EngineConfig.batch_invariant off for this model"
        )
    half = x.shape[-1] // 2
    return _by_rows(_GATES[act], x[..., :half]) * x[..., half:]
