"""`raylane bench throughput`: the offline engine, serial and with async scheduling, at several
batch sizes (max_num_seqs) and dtypes, against transformers' static-batch generate in the same
dtype."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Row:
    name: str
    dtype: str
    seconds: float
    engine: bool = True  # False: the transformers reference


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


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


def make_workload(
    num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # skip the low ids, where small vocabularies keep their special tokens
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])


def run_engines(
    model_dir: str,
    work: Workload,
    max_batched: int,
    max_num_seqs: int,
    modes: tuple[bool, ...],
    repeats: int = 1,
    warm: bool = True,
    dtype: str = "float32",
    capture: bool = False,
) -> list[dict[bool, float]]:
    """Seconds per timed pass, one engine per async_scheduling mode, the modes alternating
    pass by pass so drift on a shared machine hits them alike. `warm`: a whole untimed pass
    first (the first pass pays one-time costs per new batch shape, up to 40% of it)."""
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
    from transformers import AutoConfig

    picks = capture and bool(getattr(AutoConfig.from_pretrained(model_dir), "index_topk", 0))
    engines = {
        on: LLMEngine(
            EngineConfig(
                model=model_dir,
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                async_scheduling=on,
                enable_return_routed_experts=capture,
                enable_return_indexer_topk=picks,
            )
        )
        for on in modes
    }
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            return_routed_experts=capture,
            return_indexer_topk=picks,
        )
        for n in work.output_lens
    ]
    try:
        for engine in engines.values():
            warm_up = work.prompts if warm else [[1, 2, 3]]
            engine.generate(warm_up, params[: len(warm_up)], use_tqdm=False)
        passes = []
        for _ in range(repeats):
            passes.append({on: _timed_pass(engine, work, params) for on, engine in engines.items()})
        return passes
    finally:
        for engine in engines.values():
            engine.shutdown()


def _timed_pass(engine, work: Workload, params) -> float:
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == work.useful_tokens, (got, work.useful_tokens)
    return elapsed


def run_hf(model_dir: str, work: Workload, dtype: str = "float32") -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    longest = max(len(p) for p in work.prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in work.prompts])
    kwargs = {
        "attention_mask": mask,
        "do_sample": False,
        "max_new_tokens": max(work.output_lens),
        "min_new_tokens": max(work.output_lens),
        "pad_token_id": pad,
    }
    with torch.inference_mode():
        model.generate(
            ids[:1, :4], attention_mask=mask[:1, :4], max_new_tokens=2, pad_token_id=pad
        )  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return time.perf_counter() - start


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


def print_table(work: Workload, rows: list[Row], threads: int) -> None:
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    print(
        f"\nworkload: {len(work.prompts)} requests, prompt tokens "
        f"{sum(map(len, work.prompts))}, useful output tokens {work.useful_tokens}, greedy, "
        f"ignore_eos, {', '.join(dtypes)}, {threads} torch threads"
    )
    print(
        f"| {'system':<42} | {'dtype':<8} | {'seconds':>8} | {'useful tok/s':>12} | {'ratio':>6} |"
    )
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    refs = reference_seconds(rows)
    for r in rows:
        print(
            f"| {r.name:<42} | {r.dtype:<8} | {r.seconds:>8.2f} | "
            f"{work.useful_tokens / r.seconds:>12.1f} | {refs[r.dtype] / r.seconds:>5.2f}x |"
        )
    if any(not r.engine for r in rows):
        print("(ratio: against transformers generate in the same dtype)")
    else:
        print(f"(ratio: against the last {dtypes[0]} row)")
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b.dtype == r.dtype and b.name == r.name.replace(", async scheduling", ", serial")
            ),
            None,
        )
        if r.name.endswith(", async scheduling") and base:
            print(
                f"{r.name.removesuffix(', async scheduling')}, {r.dtype}: async / serial "
                f"throughput {base.seconds / r.seconds:.3f}x"
            )
    best = min((r for r in rows if r.engine), key=lambda r: r.seconds)
    print(
        f"raylane's best dtype: {best.dtype}, {work.useful_tokens / best.seconds:.1f} useful "
        f"tok/s ({best.name})"
    )


def reference_seconds(rows: list[Row]) -> dict[str, float]:
    """dtype -> the seconds each row's ratio divides: transformers in that dtype, or without
    the reference the last row of the first dtype (one scale for every dtype)."""
    hf = {r.dtype: r.seconds for r in rows if not r.engine}
    if hf:
        return hf
    first = [r for r in rows if r.dtype == rows[0].dtype]
    return dict.fromkeys({r.dtype for r in rows}, first[-1].seconds)
