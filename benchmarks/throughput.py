"""`python -m benchmarks throughput`: `raylane bench throughput` (same arguments, same tables)
plus the developers' modes, each run *instead* of the plain table on the same workload:
`--json-schema FILE` (structured.py), `--json-object` (open_ended.py), and `--batch-invariant`
with the product's tok/s table followed by ms per op kind off and on, each op's share of the
cost (batch_invariant.py, op_times.py). About 2 minutes on 2 cores with the default workload
and SmolLM2; --repeats 2 on a busy machine."""

from __future__ import annotations

import argparse

from raylane.bench import throughput as product
from raylane.bench.throughput import DTYPES, chosen_dtypes
from raylane.bench.throughput_runs import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    product.add_arguments(parser)
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        help="instead: tok/s with every request constrained to this JSON schema "
        "vs unconstrained, at the first --batch-sizes value, float32 (e.g. "
        "cluster/examples/bench_schema.json)",
    )
    parser.add_argument(
        "--json-object",
        action="store_true",
        help="instead: open-ended json_object answers and a required tool call with a "
        "free-text argument, each beside free text of the same lengths (time per output "
        "token, p99 token gap), at every --batch-sizes value, up to the --output-len MAX "
        "tokens, float32",
    )


def run(args: argparse.Namespace) -> int:
    if not (args.batch_invariant or args.json_object or args.json_schema):
        return product.run(args)
    model_dir, work = product.model_and_workload(args)
    if args.batch_invariant:
        return _batch_invariant(args, model_dir, work)
    if args.json_object:
        return _json_object(args, model_dir)
    return _json_schema(args, model_dir, work)


def _first_batch_size(args: argparse.Namespace) -> int:
    return int(args.batch_sizes.split(",")[0])


def _batch_invariant(args: argparse.Namespace, model_dir: str, work: Workload) -> int:
    import torch

    from benchmarks.batch_invariant import print_modes, run_modes

    size = _first_batch_size(args)
    dtypes = chosen_dtypes(args) if args.dtype else list(DTYPES)
    runs = [
        run_modes(model_dir, work, dtype, args.max_num_batched_tokens, size, args.repeats)
        for dtype in dtypes
    ]
    print_modes(work, runs, size, torch.get_num_threads())
    return 0


def _json_object(args: argparse.Namespace, model_dir: str) -> int:
    from benchmarks.open_ended import print_gap_table, run_open_ended

    gap_rows = []
    for size in (int(x) for x in args.batch_sizes.split(",")):
        gap_rows += run_open_ended(model_dir, size, args.output_len[1])
    print_gap_table(gap_rows, args.output_len[1])
    return 0


def _json_schema(args: argparse.Namespace, model_dir: str, work: Workload) -> int:
    from benchmarks.structured import print_schema_table, run_schema

    if chosen_dtypes(args) != ["float32"]:
        raise SystemExit("--json-schema runs in float32; drop --dtype")
    size = _first_batch_size(args)
    schema = args.json_schema
    rows = run_schema(model_dir, work, schema, args.max_num_batched_tokens, size, args.repeats)
    print_schema_table(rows, schema, size)
    return 0
