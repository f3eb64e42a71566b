"""`raylane bench throughput --lora N`: one batch mixing N rank-16 adapters (request i on
adapter i mod N) against the base model alone, in the same run and dtype: an engine without
LoRA, and the LoRA engine running the same batch on the base model and on the adapters. The
engines alternate pass by pass, so drift on a shared machine hits them alike. Target: the mixed
batch at >= 0.8x the base model's tok/s at batch 32 on the CPU."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from raylane.bench.throughput_runs import Workload, engines_for, greedy_params
from raylane.bench.throughput_table import Row

RANK = 16


def lora_rows(args: argparse.Namespace, model_dir: str, work: Workload, dtype: str) -> list[Row]:
    """Rows for the base engine, the LoRA engine on the base model, and on N adapters mixed."""
    from raylane import LoRARequest
    from raylane.bench.lora_adapters import write_random_adapter

    count = args.lora
    size = max(int(x) for x in args.batch_sizes.split(","))
    root = tempfile.mkdtemp(prefix="raylane-bench-lora-")
    paths = [write_random_adapter(model_dir, f"{root}/a{i}", RANK, seed=i) for i in range(count)]
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    lora_options = {"enable_lora": True, "max_loras": count, "max_lora_rank": RANK}
    options = {"base": {}, "lora": lora_options}
    common = {"dtype": dtype, "max_num_seqs": size}
    params = greedy_params(work)
    mixed = [requests[i % count] for i in range(len(work.prompts))]
    with engines_for(model_dir, options, max_num_batched_tokens=4096, **common) as engines:
        for r in requests:
            engines["lora"].add_lora(r)
        runs = {
            "base": (engines["base"], None),
            "lora, base model": (engines["lora"], None),
            "lora, mixed": (engines["lora"], mixed),
        }
        best = _best_seconds(runs, work, params, args.repeats)
    return [
        Row(f"raylane, max_num_seqs={size}, no LoRA", dtype, best["base"]),
        Row(f"LoRA on, base model only (bs {size})", dtype, best["lora, base model"]),
        Row(f"LoRA on, {count} adapters mixed (bs {size})", dtype, best["lora, mixed"]),
    ]


def _best_seconds(
    runs: dict[str, tuple[Any, list | None]], work: Workload, params: list, repeats: int
) -> dict[str, float]:
    for engine, loras in runs.values():  # warm: each batch shape once
        engine.generate(work.prompts, params, use_tqdm=False, lora_request=loras)
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, (engine, loras) in runs.items():
            start = time.perf_counter()
            outs = engine.generate(work.prompts, params, use_tqdm=False, lora_request=loras)
            seconds[key].append(time.perf_counter() - start)
            got = sum(len(o.outputs[0].token_ids) for o in outs)
            assert got == work.useful_tokens, (got, work.useful_tokens)
    return {key: min(s) for key, s in seconds.items()}


def print_lora_summary(work: Workload, rows: list[Row]) -> None:
    base, mixed = rows[0], rows[-1]
    ratio = base.seconds / mixed.seconds
    print(
        f"LoRA, {mixed.dtype}: {work.useful_tokens / mixed.seconds:.1f} tok/s mixed against "
        f"{work.useful_tokens / base.seconds:.1f} base: {ratio:.2f}x (target >= 0.8x)"
    )
