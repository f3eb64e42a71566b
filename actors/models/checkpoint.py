"""Lazy views over checkpoint tensors, so a tensor-parallel rank reads only its slices.

`LazyTensor` wraps one safetensors tensor (`safe_open(...).get_slice(name)`): `narrow` and
basic slicing return further views and read nothing; `materialize()` reads only the viewed
region. `ReadStats` counts the bytes read, so tests and logs can check what a rank touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# safetensors dtype names -> torch dtypes (the ones a checkpoint of ours can hold)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class ReadStats:
    """What a load read from checkpoint files: pass one in, read it afterwards."""

    bytes_read: int = 0  # sum of numel * itemsize over the regions materialised
    tensors_read: int = 0  # number of regions materialised

    def add(self, tensor: torch.Tensor) -> None:
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.tensors_read += 1


class LazyTensor:
    """A view of a region of one checkpoint tensor; nothing is read until `materialize()`.

    Supports what weight loaders need: `shape`, `dim()`, `dtype`, `narrow`, and `[...]` with
    integers and step-1 slices. It is not a tensor: torch functions need `materialize()` first,
    so nothing reads a whole tensor by accident.
    """

    def __init__(
        self,
        source: Any,
        stats: ReadStats | None = None,
        ranges: tuple[tuple[int, int], ...] | None = None,
        kept: tuple[int, ...] | None = None,
    ) -> None:
        # source: a safetensors slice (`get_shape()`, `get_dtype()`, `[tuple of slices]`)
        self._source, self._stats = source, stats
        full = tuple(source.get_shape())
        # (start, length) per dim of the stored tensor; `kept` = stored dims still in the view
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in full)
        self._kept = kept if kept is not None else tuple(range(len(full)))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._ranges[d][1] for d in self._kept)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._kept)

    @property
    def ndim(self) -> int:
        return len(self._kept)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        name = self._source.get_dtype()
        if name not in _DTYPES:
            raise ValueError(f"checkpoint dtype {name!r} is not supported")
        return _DTYPES[name]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """Like `torch.Tensor.narrow`; ValueError when the region leaves the tensor."""
        dim = self._dim_index(dim)
        size = self.shape[dim]
        start = start + size if start < 0 else start
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(self.shape)} has no "
                f"[{start}:{start + length}] along dim {dim}"
            )
        return self._with_range(self._kept[dim], start, length)

    def __getitem__(self, key: Any) -> LazyTensor:
        """Basic indexing: integers, step-1 slices and one Ellipsis."""
        key = self._expand_key(key if isinstance(key, tuple) else (key,))
        ranges, kept = list(self._ranges), []
        for stored, size, k in zip(self._kept, self.shape, key, strict=True):
            start, length = _index_range(k, size)
            ranges[stored] = (ranges[stored][0] + start, length)
            if not isinstance(k, int):
                kept.append(stored)  # an integer index drops the dim, like torch
        return LazyTensor(self._source, self._stats, tuple(ranges), tuple(kept))

    def materialize(self) -> torch.Tensor:
        """Read exactly the viewed region into a new CPU tensor (counted in the stats)."""
        if any(length == 0 for _, length in self._ranges):
            return torch.empty(self.shape, dtype=self.dtype)  # nothing to read
        index = tuple(slice(start, start + length) for start, length in self._ranges)
        tensor = self._source[index].reshape(self.shape)  # drops the integer-indexed dims
        if self._stats is not None:
            self._stats.add(tensor)
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self._source.get_dtype()})"

    def _dim_index(self, dim: int) -> int:
        if not -self.dim() <= dim < self.dim():
            raise IndexError(f"dim {dim} is out of range for a {self.dim()}-d tensor")
        return dim % self.dim()

    def _expand_key(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        """Replace one Ellipsis by full slices and pad to one entry per dim."""
        if sum(k is Ellipsis for k in key) > 1:
            raise IndexError("an index can only have a single ellipsis")
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.dim() - len(key) + 1) + key[at + 1 :]
        if len(key) > self.dim():
            raise IndexError(f"too many indices for a {self.dim()}-d tensor")
        return key + (slice(None),) * (self.dim() - len(key))

    def _with_range(self, stored_dim: int, start: int, length: int) -> LazyTensor:
        """A view narrowed to [start, start + length) of the current range of `stored_dim`."""
        ranges = list(self._ranges)
        offset, _ = ranges[stored_dim]
        ranges[stored_dim] = (offset + start, length)
        return LazyTensor(self._source, self._stats, tuple(ranges), self._kept)


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    """A real tensor: `tensor` itself, or the region a `LazyTensor` views, read now."""
    return tensor.materialize() if isinstance(tensor, LazyTensor) else tensor


def _index_range(key: Any, size: int) -> tuple[int, int]:
    """(start, length) that an integer or step-1 slice selects from a dim of `size`."""
    if isinstance(key, int) and not isinstance(key, bool):
        index = key + size if key < 0 else key
        if not 0 <= index < size:
            raise IndexError(f"index {key} is out of bounds for a dim of size {size}")
        return index, 1
    if isinstance(key, slice):
        start, stop, step = key.indices(size)
        if step != 1:
            raise ValueError("LazyTensor: only step-1 slices are supported")
        return start, max(0, stop - start)
    raise TypeError(f"LazyTensor: unsupported index {key!r}")
