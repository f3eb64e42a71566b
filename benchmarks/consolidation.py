"""`python -m benchmarks consolidation`: tag-group parallelism against its ideal bound, and database
round trips per batch against the batch size.

The LLM is the scripted FakeLLM at a fixed latency, so the wall time measures the scheduling
of the consolidator (and its PostgreSQL work), not a model. A private PostgreSQL is started
for the run and deleted after.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import uuid
from dataclasses import dataclass


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=50.0,
        help="fixed latency of each fake LLM call (default 50)",
    )
    parser.add_argument(
        "--groups", type=_positive_int, default=32, help="distinct tag sets (default 32)"
    )
    parser.add_argument(
        "--per-group", type=_positive_int, default=16, help="memories per tag set (default 16)"
    )
    parser.add_argument(
        "--llm-batch-size",
        type=_positive_int,
        default=8,
        help="memories per LLM call for the parallelism runs (default 8)",
    )
    parser.add_argument(
        "--parallel",
        type=_positive_int,
        nargs="+",
        default=[1, 4, 8],
        help="max_parallel_groups values to time (default 1 4 8)",
    )
    parser.add_argument(
        "--round-trip-batch-sizes",
        type=_positive_int,
        nargs="+",
        default=[4, 16],
        help="llm_batch_size values for the round-trip table (default 4 16)",
    )
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        default=3,
        help="runs per setting; the best wall time counts, as in timeit, so "
        "other load on the machine does not pass for overhead (default 3)",
    )


@dataclass(frozen=True)
class Timing:
    parallel: int
    wall: float
    ideal: float


def ideal_seconds(
    groups: int, per_group: int, llm_batch_size: int, parallel: int, latency: float
) -> float:
    """The bound: groups run in waves of `parallel`, each group's batches one after another."""
    waves = math.ceil(groups / parallel)
    serial_batches = math.ceil(per_group / llm_batch_size)
    return waves * serial_batches * latency


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tests.support.pgtemp import TempPostgres

    with TempPostgres() as pg:
        timings, round_trips = asyncio.run(_measure(pg.dsn, args))
    print(_timing_table(timings, args))
    print()
    print(_round_trip_table(round_trips))
    return 0


async def _measure(dsn: str, args: argparse.Namespace):
    from raylane.actors.consolidation import MemoryStore

    store = await MemoryStore.connect(dsn)
    try:
        # Warm up: open the pool's connections and prepare their statements before timing.
        widest = max(args.parallel)
        await _consolidate(store, args, widest, llm_batch_size=2, parallel=widest, latency=0)
        return await _time_parallelism(store, args), await _count_round_trips(store, args)
    finally:
        await store.close()


async def _time_parallelism(store, args: argparse.Namespace) -> list[Timing]:
    from tqdm import tqdm

    latency = args.latency_ms / 1000
    walls: dict[int, float] = {}
    runs = [p for p in args.parallel for _ in range(args.repeat)]
    for parallel in tqdm(runs, desc="timing runs", leave=False):
        _, wall = await _consolidate(
            store, args, args.groups, args.llm_batch_size, parallel, latency
        )
        walls[parallel] = min(walls.get(parallel, math.inf), wall)
    return [
        Timing(p, wall, ideal_seconds(args.groups, args.per_group, args.llm_batch_size, p, latency))
        for p, wall in walls.items()
    ]


@dataclass(frozen=True)
class RoundTrips:
    llm_batch_size: int
    per_batch: list[int]  # as each batch's TagScope counted them
    run_statements: int  # every statement the run sent, per-run and per-round ones too


async def _count_round_trips(store, args: argparse.Namespace) -> list[RoundTrips]:
    counts = []
    for size in args.round_trip_batch_sizes:
        before = store.statements
        result, _ = await _consolidate(store, args, args.groups, size, max(args.parallel), 0)
        counts.append(
            RoundTrips(size, [b.db_round_trips for b in result.batches], store.statements - before)
        )
    return counts


async def _consolidate(
    store, args: argparse.Namespace, groups: int, llm_batch_size: int, parallel: int, latency: float
):
    from prometheus_client import CollectorRegistry
    from raylane.actors.consolidation import ConsolidationConfig, ConsolidationMetrics, Consolidator

    from tests.support.fake_llm import FakeLLM

    bank = f"bench-{uuid.uuid4().hex[:8]}"
    await store.retain_many(
        bank,
        [
            (f"group {g} fact {i}", [f"tag-{g}"])
            for i in range(args.per_group)
            for g in range(groups)
        ],
    )
    # One round holds every memory, so the bound depends only on groups and batches.
    config = ConsolidationConfig(
        batch_size=groups * args.per_group,
        llm_batch_size=llm_batch_size,
        max_parallel_groups=parallel,
    )
    metrics = ConsolidationMetrics(CollectorRegistry())
    consolidator = Consolidator(store, FakeLLM(latency=latency), config, metrics=metrics)
    started = time.perf_counter()
    result = await consolidator.run(bank)  # the whole call: operation row, lock and all
    wall = time.perf_counter() - started
    if result.total.consolidated != groups * args.per_group:
        raise RuntimeError(f"the benchmark run did not consolidate everything: {result.stats()}")
    return result, wall


def _timing_table(timings: list[Timing], args: argparse.Namespace) -> str:
    base, base_ideal = timings[0].wall, timings[0].ideal
    title = (
        f"consolidation: {args.groups} tag groups x {args.per_group} memories, "
        f"llm_batch_size {args.llm_batch_size}, fake LLM {args.latency_ms:g} ms per call, "
        f"best of {args.repeat}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    rows = []
    for t in timings:
        speedup, ideal_speedup = base / t.wall, base_ideal / t.ideal
        rows.append(
            [
                str(t.parallel),
                f"{t.wall:.3f}",
                f"{t.ideal:.3f}",
                f"{speedup:.2f}x",
                f"{ideal_speedup:.2f}x",
                f"{speedup / ideal_speedup:.1%}",
            ]
        )
    header = ["max_parallel_groups", "wall s", "ideal s", "speedup", "ideal speedup", "of ideal"]
    return title + "\n" + _markdown(header, rows)


def _round_trip_table(counts: list[RoundTrips]) -> str:
    rows = []
    for c in counts:
        batches = len(c.per_batch)
        rows.append(
            [
                str(c.llm_batch_size),
                str(batches),
                f"{min(c.per_batch)}-{max(c.per_batch)}",
                f"{c.run_statements / batches:.2f}",
                f"{c.run_statements / (batches * c.llm_batch_size):.3f}",
            ]
        )
    header = [
        "llm_batch_size",
        "batches",
        "per batch (min-max)",
        "whole run / batches",
        "whole run / memories",
    ]
    return "database round trips (statements) per LLM batch\n" + _markdown(header, rows)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---:"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
