"""`raylane bench weights`' reference and floor rows: the same bytes copied in memory (into
preallocated and into fresh tensors), packed into buckets only, and put in the object store only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Row:
    name: str
    seconds: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)


def time_copy(named: list, repeats: int) -> Row:
    """The reference: the same bytes copied once in memory into preallocated tensors."""
    import torch

    dst = [torch.empty_like(t) for _, t in named]
    row = Row("copy, preallocated (ref.)")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = time.perf_counter()
        for d, (_, t) in zip(dst, named):
            d.copy_(t)
        row.seconds.append(time.perf_counter() - start)
    row.seconds.pop(0)
    return row


def time_clone(named: list, repeats: int) -> Row:
    """The same bytes copied into fresh memory (allocation and page faults included, as any
    path that makes a new buffer pays them)."""
    row = Row("copy, fresh memory (clone)")
    for _ in range(repeats):
        start = time.perf_counter()
        copies = [t.clone() for _, t in named]
        row.seconds.append(time.perf_counter() - start)
        del copies
    return row


def time_encode(named: list, bucket: int, repeats: int) -> Row:
    """The client's own share: packing every bucket in safetensors layout into its reused
    buffer (nothing sent)."""
    from raylane.actors.models.weights import iter_buckets, pack_bucket

    row = Row("client: pack buckets only")
    scratch = None
    for _ in range(repeats + 1):  # the first pass allocates the buffer
        start = time.perf_counter()
        for b in iter_buckets(named, bucket):
            scratch = pack_bucket(b, scratch)
        row.seconds.append(time.perf_counter() - start)
    row.seconds.pop(0)
    return row


def time_put(named: list, bucket: int, repeats: int) -> Row:
    """Ray's share of the in-cluster path: every bucket put in the object store (and freed),
    nothing else; the floor of any update through it on this machine."""
    import ray
    from raylane.actors.models.weights import iter_buckets, pack_bucket

    row = Row("object store: ray.put only")
    packed = [pack_bucket(b) for b in iter_buckets(named, bucket)]
    for _ in range(repeats):
        start = time.perf_counter()
        for p in packed:
            del_ref = ray.put(p)
            del del_ref
        row.seconds.append(time.perf_counter() - start)
    return row
