"""Weight updates on the wire: tensor specs, and buckets of tensors as safetensors bytes.

A trainer's update travels as a manifest (`TensorSpec`s: HF name, full shape, dtype), checked by
every rank of every replica before any weight changes, then as bounded buckets of safetensors
bytes, each checked against the manifest from its header before a byte of it is copied. Never
pickle: a bucket decodes only to named tensors. Importing this module does not import torch
(the engine core uses the specs).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 64 << 20

# our dtype names -> safetensors' header names
_SAFETENSORS_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    _check_dtype(name)
    return getattr(torch, name)


def _check_dtype(name: str) -> None:
    if name not in _SAFETENSORS_NAMES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_SAFETENSORS_NAMES)}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update: its HF checkpoint name, full (unsharded) shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tensors: each needs a non-empty 'name'")
        if not all(isinstance(n, int) and n >= 0 for n in self.shape):
            raise ValueError(f"tensors: {self.name!r} has a bad shape {self.shape!r}")
        _check_dtype(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        if not isinstance(d, dict) or set(d) != {"name", "shape", "dtype"}:
            raise ValueError("tensors: each entry must be {'name', 'shape', 'dtype'}")
        if not isinstance(d["shape"], (list, tuple)):
            raise ValueError(f"tensors: {d['name']!r} has a bad shape {d['shape']!r}")
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass
class WeightUpdate:
    """An update in progress on one engine: its manifest, and whether a bucket went in."""

    manifest: dict[str, TensorSpec]
    loaded: set[str] = field(default_factory=set)
    dirty: bool = False  # some weights are new, some maybe old: the engine must not step

    def check(self, specs: list[TensorSpec]) -> None:
        """ValueError unless every tensor of a bucket is in the manifest, as declared."""
        for spec in specs:
            declared = self.manifest.get(spec.name)
            if declared is None:
                raise ValueError(f"bucket: tensor {spec.name!r} is not in the update's manifest")
            if declared != spec:
                raise ValueError(f"bucket: tensor {spec.name!r} is {spec.shape} {spec.dtype}, "
                                 f"the manifest says {declared.shape} {declared.dtype}")


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in named_tensors]


def bucket_specs(payload: bytes | bytearray | memoryview) -> list[TensorSpec]:
    """The specs of a safetensors payload, read from its header alone (no tensor decoded);
    ValueError when it is not a well-formed safetensors payload."""
    view = memoryview(payload)
    if len(view) < 8:
        raise ValueError("bucket: not a safetensors payload (shorter than its header size)")
    (size,) = struct.unpack("<Q", view[:8])
    if size > len(view) - 8:
        raise ValueError("bucket: not a safetensors payload (header longer than the body)")
    try:
        header = json.loads(bytes(view[8:8 + size]))
    except ValueError:
        raise ValueError("bucket: not a safetensors payload (bad header)") from None
    specs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _FROM_SAFETENSORS:
            raise ValueError(f"bucket: tensor {name!r} has an unsupported dtype")
        specs.append(TensorSpec(name, tuple(entry.get("shape", ())),
                                _FROM_SAFETENSORS[entry["dtype"]]))
    return specs


def encode_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Safetensors bytes of the tensors (contiguous CPU copies where needed)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors})


def decode_bucket(payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors payload; ValueError when it is not one."""
    from safetensors.torch import load

    try:
        return load(bytes(payload))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"bucket: not a safetensors payload ({e})") from None


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 max_bytes: int = DEFAULT_BUCKET_BYTES,
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups of tensors of at most `max_bytes` each (a bigger tensor travels alone), so an
    update never holds more than one bucket at a time."""
    if max_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
