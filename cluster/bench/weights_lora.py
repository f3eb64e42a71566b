"""`raylane bench weights --lora`: a rank-16 adapter-only sync against a full weight sync of the
same model, in the same run, on a local cluster serving it with LoRA on: both through
`RolloutClient` (over HTTP, and in the cluster through the object store), each a whole
transaction on every replica (manifest checked everywhere, buckets, commit; the weight sync also
pauses and resumes the engines, the adapter sync needs no pause)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from raylane.bench.weights_references import Row

ADMIN_KEY = "bench-weights-lora-admin"
RANK = 16


def run_lora(args: argparse.Namespace) -> int:
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
    with lora_serving(model_dir, args) as url:
        versions = iter(range(1, 10_000))
        for name, make in (
            ("HTTP", lambda: _client(url)),
            ("in-cluster", _in_cluster),
        ):
            asyncio.run(_load(make, path))
            weights, lora = Row(f"{name}, full weights"), Row(f"{name}, rank-{RANK} adapter")
            for _ in range(args.repeats):  # alternating, so drift hits both alike
                weights.seconds.append(asyncio.run(_timed_weights(make, full, next(versions))))
                lora.seconds.append(asyncio.run(_timed_lora(make, adapter, bucket)))
            rows[name] = (weights, lora)
    _print(rows, _nbytes(full), _nbytes(adapter), args, torch.get_num_threads())
    return 0


class lora_serving:
    """A local cluster serving `model_dir` (float32) with LoRA and the admin routes on."""

    def __init__(self, model_dir: str, args: argparse.Namespace):
        from raylane.bench.serve_targets import free_port
        from raylane.config import ClusterConfig

        engine = {"dtype": "float32", "enable_lora": True, "max_lora_rank": RANK}
        self.config = ClusterConfig(
            model=model_dir,
            served_model_name="bench",
            port=free_port(),
            replicas=args.replicas,
            torch_threads=args.torch_threads,
            admin_api_key=ADMIN_KEY,
            engine=engine,
        )

    def __enter__(self) -> str:
        from raylane import launch

        launch.start_ray()
        try:
            return launch.deploy(self.config)
        except BaseException:
            launch.shutdown()
            raise

    def __exit__(self, *exc) -> None:
        from raylane import launch

        launch.shutdown()


def _client(url: str):
    from raylane.client import RolloutClient

    return RolloutClient(url, admin_key=ADMIN_KEY)


def _in_cluster():
    from raylane.client import RolloutClient

    return RolloutClient.in_cluster()


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
