"""`python -m benchmarks hybrid`: hybrid and windowed models against transformers, and what their
per-sequence state costs.

Throughput: random-weight stand-ins (`qwen3.5-tiny`, `gpt-oss-tiny` in
cluster/bench/random_models.py) run a batch of distinct `--prompt-len`-token prompts, greedy with
ignore_eos, to 1 token and to
`--output-len` tokens, in raylane's engine and in transformers `generate` (same process, same
threads). Prefill tok/s = batch * prompt_len / t[1]; decode tok/s = batch * (output_len - 1) /
(t[output_len] - t[1]), each t the best of `--repeats` runs after a warm-up.

Memory: per sequence, from transformers' default config of each architecture (real models'
layer and head shapes) in bfloat16: the linear layers' state slot, plus one state snapshot, and
the paged K/V the engine holds at 4k / 32k / 128k tokens, against the same model with every
layer full attention. "Held" is measured on the engine's own bookkeeping: the model's KV cache
groups (layer_kinds.kv_groups) in a BlockManager, one sequence prefilled in 2048-token chunks
and decoding one token, sliding groups freeing blocks outside their window; its blocks times
one group's layers' K/V per block.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

CONFIGS = {  # label -> transformers config class, at its default shape
    "Qwen3_5TextConfig (24 linear + 8 full)": "Qwen3_5TextConfig",
    "Qwen3NextConfig (36 linear + 12 full)": "Qwen3NextConfig",
    "GptOssConfig (18 sliding-128 + 18 full)": "GptOssConfig",
    "Gemma3TextConfig (22 sliding-4096 + 4 full)": "Gemma3TextConfig",
}
LENGTHS = (4096, 32768, 131072)
MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--models", default="qwen3.5-tiny,gpt-oss-tiny")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="only the memory table")


def run(args: argparse.Namespace) -> int:
    print_memory_table()
    if args.memory_only:
        return 0
    for name in args.models.split(","):
        print_throughput(name, [int(b) for b in args.batch_sizes.split(",")], args)
    return 0


def print_memory_table() -> None:
    import transformers
    from raylane.actors.models.layer_layout import full_attention_layout, model_layout

    print("| model | state slot | + 1 snapshot | " + " | ".join(
        f"{n // 1024}k: held / all full" for n in LENGTHS) + " |")  # fmt: skip
    print("|---" * (3 + len(LENGTHS)) + "|")
    for label, cls in CONFIGS.items():
        config = getattr(transformers, cls)()
        layout, full = model_layout(config, 2), full_attention_layout(config, 2)
        cells = [
            f"{(held_kv_bytes(layout, n) + layout.state_bytes) / MIB:,.0f} / "
            f"{full.bytes_per_sequence(n, 16) / MIB:,.0f} MiB"
            for n in LENGTHS
        ]
        state = layout.state_bytes / MIB
        print(f"| {label} | {state:,.1f} MiB | {2 * state:,.1f} MiB | " + " | ".join(cells) + " |")


def held_kv_bytes(layout, num_tokens: int, block_size: int = 16, chunk: int = 2048) -> int:
    """Paged K/V bytes one sequence holds at `num_tokens`, counted by the block manager."""
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.engine.layer_kinds import kv_groups
    from raylane.actors.engine.sampling_params import SamplingParams
    from raylane.actors.engine.sequence import Sequence

    paged = [layer for layer in layout.layers if layer.kind != "linear"]
    groups = kv_groups([layer.window for layer in paged])
    blocks = BlockManager(-(-num_tokens // block_size) * groups.num_groups, block_size,
                          enable_prefix_caching=False, windows=groups.windows)  # fmt: skip
    seq = Sequence("memory", 0, [0] * num_tokens, SamplingParams(), block_size)
    while seq.num_computed_tokens < num_tokens:  # the prompt in chunks, then one decode
        blocks.free_outside_windows(seq)
        step = min(chunk, num_tokens - 1 - seq.num_computed_tokens) or 1
        blocks.allocate(seq, step)
        seq.num_computed_tokens += step
    held = blocks.num_blocks - blocks.num_free_blocks
    return held * block_size * groups.group_size * paged[0].kv_bytes_per_token


def print_throughput(name: str, batches: list[int], args: argparse.Namespace) -> None:
    import torch
    from raylane.actors.engine import EngineConfig, LLMEngine
    from raylane.bench.random_models import build_random_model

    folder = build_random_model(name, tempfile.mkdtemp(prefix="raylane-hybrid-"), "float32", "cpu")
    # NOTE: no prefix caching: every timed run repeats the same prompts, which would be hits
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            max_num_seqs=max(batches),
            max_num_batched_tokens=4096,
            enable_prefix_caching=False,
        )
    )
    hf = transformers_model(folder)
    print(f"\n{name}, float32, {torch.get_num_threads()} threads, prompt {args.prompt_len}, "
          f"output {args.output_len}")  # fmt: skip
    print("| system | batch | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for batch in batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(0, 4096) for _ in range(args.prompt_len)] for _ in range(batch)]
        systems = (("raylane", engine_timer(engine)), ("transformers", hf_timer(hf)))
        for _, gen in systems:  # warm-up both before timing either (see docs/benchmarks.md)
            gen(prompts[:1], 2)
        for label, gen in systems:
            # best of `--repeats` pairs: the machine's other load only ever adds time
            t1 = min(gen(prompts, 1) for _ in range(args.repeats))
            tn = min(gen(prompts, args.output_len) for _ in range(args.repeats))
            prefill = batch * args.prompt_len / t1
            decode = batch * (args.output_len - 1) / (tn - t1) if tn > t1 else float("nan")
            print(f"| {label} | {batch} | {prefill:,.0f} | {decode:,.0f} |")


def engine_timer(engine):
    from raylane.actors.engine import SamplingParams

    def timed(prompts, max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return timed


def transformers_model(folder: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_timer(model):
    import torch

    def timed(prompts, max_tokens: int) -> float:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        return time.perf_counter() - start

    return timed
