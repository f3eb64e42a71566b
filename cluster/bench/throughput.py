"""`raylane bench throughput`: the offline engine, serial and with async scheduling, at several
batch sizes (max_num_seqs) and dtypes, against transformers' static-batch generate in the same
dtype."""

from __future__ import annotations

import argparse

from raylane.bench.throughput_runs import Workload, make_workload, run_engines, run_hf
from raylane.bench.throughput_table import Row, print_table

DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from raylane.bench.random_models import RANDOM_MODELS

    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    model.add_argument(
        "--random-model",
        choices=sorted(RANDOM_MODELS),
        help="random weights in this model's shape (e.g. deepseek-v3-tiny), built in a temp dir",
    )
    parser.add_argument(
        "--capture",
        action="store_true",
        help="also run serial with routed-expert capture on (MoE models; and indexer top-k "
        "on sparse-attention models): its cost",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument(
        "--batch-sizes",
        default="32",
        metavar="N[,N...]",
        help="max_num_seqs values to run the engine at, serial and with async "
        "scheduling (default 32: the whole default workload at once)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed passes per mode after a warm pass (the best is reported)",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        type=_dtype_list,
        metavar="DTYPE[,DTYPE]",
        help=f"{' or '.join(DTYPES)}, repeatable or a comma list (default "
        "float32); the engine and the transformers reference run in each",
    )
    parser.add_argument(
        "--skip-hf", action="store_true", help="do not run the transformers reference"
    )
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        help="instead: tok/s with every request constrained to this JSON schema "
        "vs unconstrained, at the first --batch-sizes value, float32 (e.g. "
        "cluster/examples/bench_schema.json)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="instead: tok/s with the batch-invariant mode (`raylane serve --batch-invariant`) "
        "off and on, two engines side by side, serial scheduling, at the first --batch-sizes "
        "value, in float32 and bfloat16 (or the --dtype given), with the ratio; then "
        "--repeats op-timed passes each (the fastest is shown): ms per op kind (linears, "
        "fused RMSNorm/SiLU/RoPE, attention, the rest) off and on, and each op's share of "
        "the cost. About 2 minutes on 2 cores with the default workload and SmolLM2; "
        "--repeats 2 on a busy machine",
    )
    parser.add_argument(
        "--json-object",
        action="store_true",
        help="instead: open-ended json_object answers and a required tool call with a "
        "free-text argument, each beside free text of the same lengths (time per output "
        "token, p99 token gap), at every --batch-sizes value, up to the --output-len MAX "
        "tokens, float32",
    )


def _dtype_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)} is not one of {', '.join(DTYPES)}"
        )
    return names


def chosen_dtypes(args: argparse.Namespace) -> list[str]:
    """The --dtype values in order, each once; float32 when none was given."""
    return list(dict.fromkeys(d for group in args.dtype or [["float32"]] for d in group))


def run(args: argparse.Namespace) -> int:
    import torch
    from raylane.models import default_model_path
    from transformers import AutoConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_model:
        import tempfile

        from raylane.bench.random_models import build_random_model

        model_dir = build_random_model(
            args.random_model, tempfile.mkdtemp(prefix="raylane-throughput-"), "float32", "cpu"
        )
    else:
        model_dir = args.model or default_model_path()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    work = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed
    )
    if args.batch_invariant:
        return _batch_invariant(args, model_dir, work)
    dtypes = chosen_dtypes(args)
    if args.json_object:
        from raylane.bench.open_ended import print_gap_table, run_open_ended

        gap_rows = []
        for size in (int(x) for x in args.batch_sizes.split(",")):
            gap_rows += run_open_ended(model_dir, size, args.output_len[1])
        print_gap_table(gap_rows, args.output_len[1])
        return 0
    if args.json_schema:
        if dtypes != ["float32"]:
            raise SystemExit("--json-schema runs in float32; drop --dtype")
        from raylane.bench.structured import print_schema_table, run_schema

        size = int(args.batch_sizes.split(",")[0])
        print_schema_table(
            run_schema(
                model_dir, work, args.json_schema, args.max_num_batched_tokens, size, args.repeats
            ),
            args.json_schema,
            size,
        )
        return 0
    rows = []
    for dtype in dtypes:
        rows += engine_rows(args, model_dir, work, dtype)
        if not args.skip_hf:
            rows.append(
                Row(
                    "transformers generate (static batch)",
                    dtype,
                    run_hf(model_dir, work, dtype),
                    engine=False,
                )
            )
    print_table(work, rows, torch.get_num_threads())
    return 0


def _batch_invariant(args: argparse.Namespace, model_dir: str, work: Workload) -> int:
    import torch
    from raylane.bench.batch_invariant import print_modes, run_modes

    size = int(args.batch_sizes.split(",")[0])
    dtypes = chosen_dtypes(args) if args.dtype else list(DTYPES)
    runs = [
        run_modes(model_dir, work, dtype, args.max_num_batched_tokens, size, args.repeats)
        for dtype in dtypes
    ]
    print_modes(work, runs, size, torch.get_num_threads())
    return 0


def engine_rows(
    args: argparse.Namespace,
    model_dir: str,
    work: Workload,
    dtype: str,
) -> list[Row]:
    rows = []
    for size in (int(x) for x in args.batch_sizes.split(",")):
        passes = run_engines(
            model_dir,
            work,
            args.max_num_batched_tokens,
            size,
            (False, True),
            args.repeats,
            dtype=dtype,
        )
        for mode, on in (("serial", False), ("async scheduling", True)):
            rows.append(
                Row(f"raylane, max_num_seqs={size}, {mode}", dtype, min(p[on] for p in passes))
            )
        if args.capture:
            captured = run_engines(
                model_dir,
                work,
                args.max_num_batched_tokens,
                size,
                (False,),
                args.repeats,
                dtype=dtype,
                capture=True,
            )
            name = f"raylane, max_num_seqs={size}, serial, capture"
            rows.append(Row(name, dtype, min(p[False] for p in captured)))
    return rows
