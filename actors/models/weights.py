"""Weight updates on the wire: tensor specs, and buckets of tensors as safetensors bytes.

A trainer's update travels as a manifest (`TensorSpec`s: HF name, full shape, dtype), checked by
every rank of every replica before any weight changes, then as bounded buckets of safetensors
bytes, each checked against the manifest from its header before a byte of it is copied. Never
pickle: a bucket decodes only to named tensors. Importing this module does not import torch
(the engine core uses the specs).
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

Payload = bytes | bytearray | memoryview | Any  # safetensors bytes, or a uint8 numpy array

DEFAULT_BUCKET_BYTES = 64 << 20

# our dtype names -> safetensors' header names
_SAFETENSORS_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_NAMES.items()}
_ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


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
    open_ended: bool = False  # begun without a manifest: each receive brings its tensors
    loaded: set[str] = field(default_factory=set)
    dirty: bool = False  # some weights are new, some maybe old: the engine must not step

    def check(self, specs: list[TensorSpec]) -> None:
        """ValueError unless every tensor of a bucket is in the manifest, as declared."""
        for spec in specs:
            declared = self.manifest.get(spec.name)
            if declared is None:
                raise ValueError(f"bucket: tensor {spec.name!r} is not in the update's manifest")
            if declared != spec:
                raise ValueError(
                    f"bucket: tensor {spec.name!r} is {spec.shape} {spec.dtype}, "
                    f"the manifest says {declared.shape} {declared.dtype}"
                )


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in named_tensors]


def bucket_specs(payload: Payload) -> list[TensorSpec]:
    """The specs of a safetensors payload, read from its header alone (no tensor decoded);
    ValueError when it is not a well-formed safetensors payload."""
    return [spec for spec, _ in _entries(payload)[0]]


def _entries(payload: Payload) -> tuple[list[tuple[TensorSpec, tuple[int, int]]], int]:
    """Each tensor's spec and byte range in the body, and where the body starts; ValueError
    unless the header is well formed and every range lies in the body with its tensor's size."""
    view = memoryview(payload).cast("B")
    if len(view) < 8:
        raise ValueError("bucket: not a safetensors payload (shorter than its header size)")
    (size,) = struct.unpack("<Q", view[:8])
    if size > len(view) - 8:
        raise ValueError("bucket: not a safetensors payload (header longer than the body)")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
    except ValueError:
        raise ValueError("bucket: not a safetensors payload (bad header)") from None
    if not isinstance(header, dict):
        raise ValueError("bucket: not a safetensors payload (bad header)")
    body = len(view) - 8 - size
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _FROM_SAFETENSORS:
            raise ValueError(f"bucket: tensor {name!r} has an unsupported dtype")
        dtype = _FROM_SAFETENSORS[entry["dtype"]]
        shape = entry.get("shape", ())
        if not isinstance(shape, list):
            raise ValueError(f"bucket: tensor {name!r} has a bad shape {shape!r}")
        spec = TensorSpec(name, tuple(shape), dtype)
        span = entry.get("data_offsets")
        nbytes = math.prod(spec.shape) * _ITEM_SIZES[dtype]
        if (
            not isinstance(span, list)
            or len(span) != 2
            or not all(isinstance(x, int) for x in span)
            or not 0 <= span[0] <= span[1] <= body
            or span[1] - span[0] != nbytes
        ):
            raise ValueError(f"bucket: tensor {name!r} has bad data offsets {span!r}")
        entries.append((spec, (span[0], span[1])))
    return entries, 8 + size


def pack_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], scratch: np.ndarray | None = None
) -> np.ndarray:
    """The tensors in safetensors layout in one uint8 array: a header, then each tensor's
    bytes, copied once. A Ray object store holds it without a copy on the reading side.
    `scratch`: a uint8 array to write into when it is large enough (the result is then a view
    of it, valid until the next use; fresh memory costs page faults on every bucket)."""
    import numpy as np
    import torch

    tensors = [(name, t.detach()) for name, t in named_tensors]
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype_name(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the body starts 8-byte aligned, as safetensors writes it
    total = 8 + len(head) + offset
    out = (
        scratch[:total]
        if scratch is not None and scratch.size >= total
        else np.empty(total, dtype=np.uint8)
    )
    out[:8] = np.frombuffer(struct.pack("<Q", len(head)), dtype=np.uint8)
    out[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    body = torch.from_numpy(out[8 + len(head) :])
    for (name, t), entry in zip(tensors, header.values()):
        begin, end = entry["data_offsets"]
        if end > begin:
            body[begin:end].copy_(t.to("cpu").contiguous().reshape(-1).view(torch.uint8))
    return out


def encode_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Safetensors bytes of the tensors (what an HTTP bucket carries)."""
    return pack_bucket(named_tensors).tobytes()


def decode_bucket(payload: Payload) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors payload, as views into it (no copy: the loaders copy
    them into the model); ValueError when it is not a well-formed payload."""
    import torch

    entries, start = _entries(payload)
    view = memoryview(payload).cast("B")
    tensors = {}
    with warnings.catch_warnings():  # a read-only payload (bytes, the object store) is only read
        warnings.simplefilter("ignore", UserWarning)
        for spec, (begin, end) in entries:
            dtype = torch_dtype(spec.dtype)
            if end == begin:
                tensors[spec.name] = torch.empty(spec.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(
                view, dtype=torch.uint8, count=end - begin, offset=start + begin
            )
            tensors[spec.name] = flat.view(dtype).view(spec.shape)
    return tensors


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
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


# vLLM's default packed buffer (its `packed_buffer_size_bytes`)
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # NOTE: also in actors/engine/weight_transfer.py


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * _ITEM_SIZES[spec.dtype]


def broadcast_chunks(
    specs: list[TensorSpec], packed: bool, buffer_bytes: int = DEFAULT_PACKED_BUFFER_BYTES
) -> list[list[TensorSpec]]:
    """How a trainer's broadcasts split the tensors: one per tensor, or (vLLM's `packed`) the
    tensors in order, each chunk closed by the tensor that takes its byte count past
    `buffer_bytes` (so a chunk may exceed it), the rest in a last chunk. A chunk travels as
    its tensors' bytes back to back, with no padding."""
    if not packed:
        return [[spec] for spec in specs]
    if buffer_bytes <= 0:
        raise ValueError("packed_buffer_size_bytes: must be > 0")
    chunks: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        chunks[-1].append(spec)
        size += nbytes(spec)
        if size > buffer_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]
