"""`raylane bench throughput`: the offline engine, serial and with async scheduling, at several
batch sizes (max_num_seqs) and dtypes, against transformers' static-batch generate in the same
dtype; instead, with --lora, adapters mixed in a batch, and with --batch-invariant, the
batch-invariant mode off vs on (batch_invariant.py)."""

from __future__ import annotations

import argparse

from raylane.bench.throughput_runs import Workload, make_workload, run_engines, run_hf
from raylane.bench.throughput_table import Row, print_table

DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    _add_workload_arguments(parser)
    _add_run_arguments(parser)
    _add_instead_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from raylane.bench.random_models import RANDOM_MODELS

    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    model.add_argument(
        "--random-model",
        choices=sorted(RANDOM_MODELS),
        help="random weights in this model's shape (e.g. deepseek-v3-tiny), built in a temp dir",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        type=_dtype_list,
        metavar="DTYPE[,DTYPE]",
        help=f"{' or '.join(DTYPES)}, repeatable or a comma list (default "
        "float32); the engine and the transformers reference run in each",
    )


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--skip-hf", action="store_true", help="do not run the transformers reference"
    )
    parser.add_argument(
        "--capture",
        action="store_true",
        help="also run serial with routed-expert capture on (MoE models; and indexer top-k "
        "on sparse-attention models): its cost",
    )


def _add_instead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora",
        type=int,
        metavar="N",
        help="instead: a batch mixing N rank-16 adapters against the base model alone, "
        "same run (the largest --batch-sizes value)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="instead: tok/s with the batch-invariant mode (`raylane serve --batch-invariant`) "
        "off and on, two engines side by side, serial scheduling, at the first --batch-sizes "
        "value, in float32 and bfloat16 (or the --dtype given), with the ratio",
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


def model_and_workload(args: argparse.Namespace) -> tuple[str, Workload]:
    """The model directory (a random model is built in a temp dir) and the seeded workload."""
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
    return model_dir, work


def run(args: argparse.Namespace) -> int:
    import torch

    model_dir, work = model_and_workload(args)
    if args.lora:
        return run_lora(args, model_dir, work)
    if args.batch_invariant:
        return run_batch_invariant(args, model_dir, work)
    rows = []
    for dtype in chosen_dtypes(args):
        rows += engine_rows(args, model_dir, work, dtype)
        if not args.skip_hf:
            hf = run_hf(model_dir, work, dtype)
            rows.append(Row("transformers generate (static batch)", dtype, hf, engine=False))
    print_table(work, rows, torch.get_num_threads())
    return 0


def run_batch_invariant(args: argparse.Namespace, model_dir: str, work: Workload) -> int:
    from raylane.bench import batch_invariant

    dtypes = chosen_dtypes(args) if args.dtype else list(DTYPES)
    size = int(args.batch_sizes.split(",")[0])
    max_batched = args.max_num_batched_tokens
    return batch_invariant.run(model_dir, work, dtypes, max_batched, size, args.repeats)


def run_lora(args: argparse.Namespace, model_dir: str, work: Workload) -> int:
    import torch
    from raylane.bench.throughput_lora import lora_rows, print_lora_summary

    if args.lora < 1:
        raise ValueError("--lora: give at least 1 adapter")
    for dtype in chosen_dtypes(args):
        rows = lora_rows(args, model_dir, work, dtype)
        print_table(work, rows, torch.get_num_threads())
        print_lora_summary(work, rows)
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
