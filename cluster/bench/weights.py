"""`raylane bench weights`: how fast a trainer's weights reach the engine replicas.

Starts a local cluster serving the model (float32, admin routes on) and times
`RolloutClient.update_weights` for every weight of the model, over HTTP (safetensors buckets on
the admin routes) and in the cluster (each bucket put in the object store once, the Router
forwarding the reference), against a plain in-memory copy of the same bytes measured in the
same run (the target: the in-cluster update at >= 50% of the copy's GB/s). Each update is a
whole transaction: manifest check on every replica, buckets, commit. Then, with requests in
flight, it times pause("keep") -> update -> resume, and checks that the requests' per-token
weight versions switch once, where the update happened.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from raylane.bench.weights_pause import PauseRun, pause_update_resume
from raylane.bench.weights_references import (
    Row,
    time_clone,
    time_copy,
    time_encode,
    time_put,
)

ADMIN_KEY = "bench-weights-admin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="updates timed per path")
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=32,
        help="requests generating during the pause -> update -> resume run",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per replica (default: the cores split)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="instead: a rank-16 adapter-only sync against a full weight sync of the same "
        "model, same run (cluster/bench/weights_lora.py)",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from raylane.bench.weight_sender import load_named
    from raylane.models import resolve_model

    if args.lora:
        return run_lora_sync(args)
    model_dir = resolve_model(args.model)
    named = load_named(model_dir)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    bucket = args.bucket_mb << 20
    rows = [
        time_copy(named, args.repeats),
        time_clone(named, args.repeats),
        time_encode(named, bucket, args.repeats),
    ]
    with serving(model_dir, args) as url:
        rows.append(time_put(named, bucket, args.repeats))
        versions = iter(range(1, 10_000))
        rows += update_rows(url, named, bucket, args.repeats, versions)
        rows += collective_rows(url, model_dir, args.replicas + 1, bucket, args.repeats, versions)
        pauses = pause_runs(url, named, bucket, args.in_flight, versions)
    print_table(rows, pauses, nbytes, len(named), args, torch.get_num_threads())
    return 0


def run_lora_sync(args: argparse.Namespace) -> int:
    from raylane.bench.weights_lora import RANK, run_lora

    def lora_cluster(model_dir: str) -> serving:
        return serving(model_dir, args, lora_rank=RANK)

    return run_lora(args, lora_cluster, http_client, in_cluster_client)


def update_rows(url: str, named: list, bucket: int, repeats: int, versions) -> list[Row]:
    """The whole update through the admin HTTP routes and through the object store."""
    from tqdm import tqdm

    rows = []
    for name, make in (
        ("HTTP (admin routes)", lambda: http_client(url)),
        ("in-cluster (object store)", in_cluster_client),
    ):
        row = Row(name)
        for _ in tqdm(range(repeats), desc=name):
            row.seconds.append(asyncio.run(timed_update(make, named, next(versions), bucket)))
        rows.append(row)
    return rows


def pause_runs(url: str, named: list, bucket: int, in_flight: int, versions) -> list[PauseRun]:
    """pause('keep') -> update -> resume with requests in flight, in-cluster and over HTTP."""
    return [
        asyncio.run(pause_update_resume(make, url, named, next(versions), bucket, in_flight, name))
        for name, make in (("in-cluster", in_cluster_client), ("HTTP", lambda: http_client(url)))
    ]


def collective_rows(
    url: str, model_dir: str, world_size: int, bucket: int, repeats: int, versions
) -> list:
    """A trainer process broadcasting over gloo (vLLM's packed chunks of `bucket` bytes): into
    the cluster through vLLM's routes (receive, load, commit), and the raw floor into bare
    receivers, same world size."""
    from raylane.bench.serve_targets import free_port
    from raylane.bench.weights_collective import time_collective, time_raw

    packing = {"packed": True, "buffer": bucket}
    raw = Row(
        "raw gloo broadcast (ref.)", time_raw(model_dir, world_size, repeats, packing, free_port())
    )
    seconds = time_collective(
        url, ADMIN_KEY, model_dir, world_size, repeats, packing, free_port(), versions
    )
    return [raw, Row("collective (gloo, vLLM routes)", seconds)]


class serving:
    """A local cluster serving `model_dir` in float32 with the admin routes on (and LoRA
    adapters up to `lora_rank`, if given); yields its URL."""

    def __init__(self, model_dir: str, args: argparse.Namespace, lora_rank: int | None = None):
        from raylane.bench.serve_targets import free_port
        from raylane.config import ClusterConfig

        self.config = ClusterConfig(
            model=model_dir,
            served_model_name="bench",
            port=free_port(),
            replicas=args.replicas,
            torch_threads=args.torch_threads,
            admin_api_key=ADMIN_KEY,
            trainer_api=True,
            engine={
                "dtype": "float32",
                "max_num_seqs": max(32, args.in_flight),
                **({"enable_lora": True, "max_lora_rank": lora_rank} if lora_rank else {}),
            },
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


def http_client(url: str):
    from raylane.client import RolloutClient

    return RolloutClient(url, admin_key=ADMIN_KEY)


def in_cluster_client():
    from raylane.client import RolloutClient

    return RolloutClient.in_cluster()


async def timed_update(make, named: list, version: int, bucket: int) -> float:
    async with make() as client:
        start = time.perf_counter()
        await client.update_weights(named, version, bucket)
        return time.perf_counter() - start


def _row(rows: list[Row], prefix: str) -> Row:
    return next(r for r in rows if r.name.startswith(prefix))


def print_table(
    rows: list[Row],
    pauses: list[PauseRun],
    nbytes: int,
    num_tensors: int,
    args: argparse.Namespace,
    threads: int,
) -> None:
    print(
        f"\nupdate: {num_tensors} tensors, {nbytes / 1e9:.3f} GB float32, {args.bucket_mb} MiB "
        f"buckets, {args.replicas} replica(s), best of {args.repeats}; driver torch threads "
        f"{threads}"
    )
    print_update_rows(rows, nbytes)
    print_pauses(pauses, args.in_flight)


def print_update_rows(rows: list[Row], nbytes: int) -> None:
    """Each path's time and GB/s against the preallocated copy (rows[0]), then the ratios."""
    copy_gbs = nbytes / rows[0].best / 1e9
    print(f"| {'path':<30} | {'seconds':>8} | {'median s':>8} | {'GB/s':>6} | {'vs copy':>7} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    for row in rows:
        gbs = nbytes / row.best / 1e9
        print(
            f"| {row.name:<30} | {row.best:>8.3f} | {statistics.median(row.seconds):>8.3f} | "
            f"{gbs:>6.2f} | {100 * gbs / copy_gbs:>6.0f}% |"
        )
    clone_gbs = nbytes / rows[1].best / 1e9
    cluster_gbs = nbytes / _row(rows, "in-cluster").best / 1e9
    raw_gbs = nbytes / _row(rows, "raw gloo").best / 1e9
    collective_gbs = nbytes / _row(rows, "collective").best / 1e9
    put_gbs = nbytes / _row(rows, "object store").best / 1e9
    print(
        f"collective update (receive, load, commit): {100 * collective_gbs / raw_gbs:.0f}% of "
        "the raw gloo broadcast of the same bytes (target >= 50%)"
    )
    print(
        f"in-cluster update: {100 * cluster_gbs / copy_gbs:.0f}% of the preallocated copy "
        f"(target >= 50%), {100 * cluster_gbs / clone_gbs:.0f}% of the fresh-memory copy, "
        f"{100 * cluster_gbs / put_gbs:.0f}% of ray.put alone"
    )


def print_pauses(pauses: list[PauseRun], in_flight: int) -> None:
    print(
        f"\npause('keep') -> update -> resume with {in_flight} requests in flight "
        "(greedy, 96 tokens each):"
    )
    print(
        f"| {'path':<10} | {'pause ms':>8} | {'update s':>8} | {'resume ms':>9} | "
        f"{'total s':>7} | {'switched at the update':>22} | {'finished':>8} |"
    )
    print(f"|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 24}|{'-' * 10}|")
    for p in pauses:
        total = p.pause_s + p.update_s + p.resume_s
        print(
            f"| {p.name:<10} | {1e3 * p.pause_s:>8.1f} | {p.update_s:>8.3f} | "
            f"{1e3 * p.resume_s:>9.1f} | {total:>7.3f} | "
            f"{f'{p.spanning}/{in_flight}':>22} | {p.finished:>8} |"
        )
