"""`raylane bench weights --lora`: a rank-16 adapter-only sync against a full weight sync of the
same model, in the same run, on a local cluster serving it with LoRA on (weights.py's
`serving`): both through `RolloutClient` (over HTTP, and in the cluster through the object
store), each a whole transaction on every replica (manifest checked everywhere, buckets, commit;
the weight sync also pauses and resumes the engines, the adapter sync needs no pause)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from raylane.bench.weights_references import Row

RANK = 16


def run_lora(
    args: argparse.Namespace,
    cluster: Callable[[str], AbstractContextManager[str]],
    http_client: Callable[[str], Any],
    in_cluster_client: Callable[[], Any],
) -> int:
    """`cluster(model_dir)` serves the model with LoRA on (yields its URL); the two client
    makers are weights.py's."""
    import torch
    from raylane.bench.lora_adapters import random_adapter_tensors, write_random_adapter
    from raylane.bench.weight_sender import load_named
    from raylane.models import resolve_model

    model_dir = resolve_model(args.model)
    full = load_named(model_dir)
    adapter = random_adapter_tensors(model_dir, RANK, seed=1)
    path = write_random_adapter(model_dir, tempfile.mkdtemp(prefix="raylane-lora-"), RANK)
    bucket = args.bucket_mb << 20
    rows: dict[str, tuple[Row, Row]] = {}
    with cluster(model_dir) as url:
        versions = iter(range(1, 10_000))
        for name, make in (("HTTP", lambda: http_client(url)), ("in-cluster", in_cluster_client)):
            asyncio.run(_load(make, path))
            weights, lora = Row(f"{name}, full weights"), Row(f"{name}, rank-{RANK} adapter")
            for _ in range(args.repeats):  # alternating, so drift hits both alike
                weights.seconds.append(asyncio.run(_timed_weights(make, full, next(versions))))
                lora.seconds.append(asyncio.run(_timed_lora(make, adapter, bucket)))
            rows[name] = (weights, lora)
    _print(rows, _nbytes(full), _nbytes(adapter), args, torch.get_num_threads())
    return 0


async def _load(make, path: str) -> None:
    async with make() as client:
        await client.load_lora("bench-adapter", path, replace=True)


async def _timed_weights(make, named: list, version: int) -> float:
    async with make() as client:
        start = time.perf_counter()
        await client.update_weights(named, version)
        return time.perf_counter() - start


async def _timed_lora(make, named: list, bucket: int) -> float:
    async with make() as client:
        start = time.perf_counter()
        await client.update_lora("bench-adapter", named, bucket_bytes=bucket)
        return time.perf_counter() - start


def _nbytes(named: list) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _print(
    rows: dict[str, tuple[Row, Row]],
    full_bytes: int,
    adapter_bytes: int,
    args: argparse.Namespace,
    threads: int,
) -> None:
    print(
        f"\nfull weights {full_bytes / 1e6:.1f} MB float32 against a rank-{RANK} adapter on "
        f"every projection {adapter_bytes / 1e6:.1f} MB; {args.replicas} replica(s), best of "
        f"{args.repeats}; driver torch threads {threads}"
    )
    print(f"| {'path':<28} | {'MB':>8} | {'seconds':>8} | {'GB/s':>6} | {'vs full':>7} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    for weights, lora in rows.values():
        for row, size in ((weights, full_bytes), (lora, adapter_bytes)):
            print(
                f"| {row.name:<28} | {size / 1e6:>8.1f} | {row.best:>8.3f} | "
                f"{size / row.best / 1e9:>6.2f} | {weights.best / row.best:>6.1f}x |"
            )
