"""`raylane bench throughput`: the offline engine, serial and with async scheduling, at several
batch sizes (max_num_seqs), against transformers' static-batch generate."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--batch-sizes", default="32", metavar="N[,N...]",
                        help="max_num_seqs values to run the engine at, serial and with async "
                             "scheduling (default 32: the whole default workload at once)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed passes per mode after a warm pass (the best is reported)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers "
                                                               "reference")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="instead: tok/s with every request constrained to this JSON schema "
                             "vs unconstrained, at the first --batch-sizes value (e.g. "
                             "cluster/examples/bench_schema.json)")


def make_workload(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # skip the low ids, where small vocabularies keep their special tokens
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))]
               for _ in range(num)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])


def run_engines(model_dir: str, work: Workload, max_batched: int, max_num_seqs: int,
                modes: tuple[bool, ...], repeats: int = 1, warm: bool = True,
                ) -> list[dict[bool, float]]:
    """Seconds per timed pass, one engine per async_scheduling mode, the modes alternating
    pass by pass so drift on a shared machine hits them alike. `warm`: a whole untimed pass
    first (the first pass pays one-time costs per new batch shape, up to 40% of it)."""
    from actors.engine import EngineConfig, LLMEngine, SamplingParams

    engines = {on: LLMEngine(EngineConfig(model=model_dir, dtype="float32",
                                          max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_batched,
                                          async_scheduling=on)) for on in modes}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    try:
        for engine in engines.values():
            warm_up = work.prompts if warm else [[1, 2, 3]]
            engine.generate(warm_up, params[:len(warm_up)], use_tqdm=False)
        passes = []
        for _ in range(repeats):
            passes.append({on: _timed_pass(engine, work, params)
                           for on, engine in engines.items()})
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


def run_hf(model_dir: str, work: Workload) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    longest = max(len(p) for p in work.prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in work.prompts])
    kwargs = {"attention_mask": mask, "do_sample": False, "max_new_tokens": max(work.output_lens),
                  "min_new_tokens": max(work.output_lens), "pad_token_id": pad}
    with torch.inference_mode():
        model.generate(ids[:1, :4], attention_mask=mask[:1, :4], max_new_tokens=2,
                       pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    from cluster.models import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_path()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    work = make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab,
                         args.seed)
    if args.json_schema:
        from cluster.bench.structured import print_schema_table, run_schema

        size = int(args.batch_sizes.split(",")[0])
        print_schema_table(run_schema(model_dir, work, args.json_schema,
                                      args.max_num_batched_tokens, size, args.repeats),
                           args.json_schema, size)
        return 0
    rows = []
    for size in (int(x) for x in args.batch_sizes.split(",")):
        passes = run_engines(model_dir, work, args.max_num_batched_tokens, size, (False, True),
                             args.repeats)
        for mode, on in (("serial", False), ("async scheduling", True)):
            rows.append((f"raylane, max_num_seqs={size}, {mode}", min(p[on] for p in passes)))
    if not args.skip_hf:
        rows.append(("transformers generate (static batch)", run_hf(model_dir, work)))
    print_table(work, rows, torch.get_num_threads())
    return 0


def print_table(work: Workload, rows: list[tuple[str, float]], threads: int) -> None:
    print(f"\nworkload: {len(work.prompts)} requests, prompt tokens "
          f"{sum(map(len, work.prompts))}, useful output tokens {work.useful_tokens}, greedy, "
          f"ignore_eos, float32, {threads} torch threads")
    print(f"| {'system':<42} | {'seconds':>8} | {'useful tok/s':>12} | {'ratio':>6} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    ref = rows[-1][1]
    for name, secs in rows:
        print(f"| {name:<42} | {secs:>8.2f} | {work.useful_tokens / secs:>12.1f} | "
              f"{ref / secs:>5.2f}x |")
    print("(ratio: against the last row)")
    serial = {name.removesuffix(", serial"): secs for name, secs in rows if
              name.endswith(", serial")}
    for name, secs in rows:
        base = serial.get(name.removesuffix(", async scheduling"))
        if name.endswith(", async scheduling") and base:
            print(f"{name.removesuffix(', async scheduling')}: async / serial throughput "
                  f"{base / secs:.3f}x")
