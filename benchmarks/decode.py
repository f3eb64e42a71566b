"""`python -m benchmarks decode`: decode tok/s with CUDA graphs, eager, and transformers `generate`.

Every system runs a batch of distinct `--prompt-len`-token prompts twice, greedy with
ignore_eos: once to `--output-len` tokens and once to a single token. The difference of the two
times is the decode part (the prefill and the first token cancel out), so decode tok/s is
batch * (output_len - 1) / (t[output_len] - t[1]), the best of `--repeats` pairs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from dataclasses import replace

from raylane.bench.random_models import RANDOM_MODELS, build_random_model

from benchmarks.decode_table import Cell, print_table, progress

DEFAULT_LABEL = "SmolLM2-135M-Instruct (embedded)"
SYSTEMS = {"graphs": False, "eager": True}  # name -> EngineConfig.enforce_eager


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    model.add_argument(
        "--random-model",
        choices=sorted(RANDOM_MODELS),
        help="random weights in this model's shape, built into a temp dir",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on CUDA, float32 on the CPU",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA when there is one), cuda, cpu, ..."
    )
    parser.add_argument("--batch-sizes", default="1,8,32,64", metavar="N[,N...]")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens per sequence (>= 2); the last output_len - 1 are decode",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engines' max_model_len, which sizes the graphs' block tables "
        "(default: prompt_len + output_len + 1)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed pairs per batch size after a warm pass (the best is reported)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.output_len < 2:
        raise SystemExit("--output-len must be >= 2: one token is the prefill's")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    scratch = tempfile.mkdtemp(prefix="raylane-decode-") if args.random_model else None
    try:
        model_dir, label = _model(args, scratch, dtype, device)
        prompts = _prompts(model_dir, max(sizes), args.prompt_len, args.seed)
        columns: dict[str, dict[int, Cell]] = {}
        for name, eager in SYSTEMS.items():
            columns[name] = time_engine(model_dir, args, str(device), dtype, eager, prompts, sizes)
        if not args.skip_hf:
            columns["transformers"] = time_hf(
                model_dir, device, dtype, prompts, sizes, args.output_len, args.repeats
            )
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print_table(columns, sizes, args, label, dtype, device, model_len(args))
    return 0


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _model(args: argparse.Namespace, scratch: str | None, dtype: str, device) -> tuple[str, str]:
    """(model directory, label for the table)."""
    if scratch is not None:  # --random-model: the weights are written there
        build_random_model(args.random_model, scratch, dtype, device)
        return scratch, f"{args.random_model}-shaped random weights"
    if args.model:
        from raylane.actors.models.gguf import gguf_to_hf_dir

        # transformers (the reference, and the config read here) wants an HF directory
        path = gguf_to_hf_dir(args.model) if args.model.endswith(".gguf") else args.model
        return path, os.path.basename(os.path.normpath(args.model))
    from raylane.models import default_model_path

    return default_model_path(), DEFAULT_LABEL


def _prompts(model_dir: str, count: int, length: int, seed: int) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(seed)
    # skip the low ids, where small vocabularies keep their special tokens
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


# --- raylane -------------------------------------------------------------------------------


def time_engine(
    model_dir: str,
    args: argparse.Namespace,
    device: str,
    dtype: str,
    eager: bool,
    prompts: list[list[int]],
    sizes: list[int],
) -> dict[int, Cell]:
    from raylane.actors.engine import EngineConfig, LLMEngine

    longest, per_seq = max(sizes), args.prompt_len + args.output_len
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        device=device,
        max_num_seqs=longest,
        max_num_batched_tokens=max(2048, longest * args.prompt_len),
        max_model_len=model_len(args),
        num_kv_blocks=longest * (-(-per_seq // 16) + 1),
        enable_prefix_caching=False,
        enforce_eager=eager,
        seed=args.seed,
    )
    engine = LLMEngine(config)
    name = "eager" if eager else "graphs"
    try:
        return {
            b: progress(
                name, b, _time_engine_batch(engine, prompts[:b], args.output_len, args.repeats)
            )
            for b in sizes
        }
    finally:
        engine.shutdown()


def model_len(args: argparse.Namespace) -> int:
    # NOTE: + 1, because with async scheduling the engine counts the pending token against
    # max_model_len and would end every sequence one token short of prompt + output
    return args.max_model_len or args.prompt_len + args.output_len + 1


def _time_engine_batch(engine, prompts: list[list[int]], output_len: int, repeats: int) -> Cell:
    from raylane.actors.engine import SamplingParams

    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    one = replace(full, max_tokens=1)
    engine.generate(prompts, full, use_tqdm=False)  # warm: per-shape costs, allocator growth
    best, replays = float("inf"), 0
    for _ in range(repeats):
        first = _engine_seconds(engine, prompts, one)
        before = engine.stats.graph_replays
        whole = _engine_seconds(engine, prompts, full)
        replays = engine.stats.graph_replays - before
        best = min(best, whole - first)
    return Cell(best, len(prompts) * (output_len - 1), replays)


def _engine_seconds(engine, prompts: list[list[int]], params) -> float:
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)  # returns host data: synced
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return elapsed


# --- transformers --------------------------------------------------------------------------


def time_hf(
    model_dir: str,
    device,
    dtype: str,
    prompts: list[list[int]],
    sizes: list[int],
    output_len: int,
    repeats: int,
) -> dict[int, Cell]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    cells = {}
    for b in sizes:
        ids = torch.tensor(prompts[:b], device=device)
        _hf_seconds(model, ids, output_len)  # warm
        best = min(
            _hf_seconds(model, ids, output_len) - _hf_seconds(model, ids, 1) for _ in range(repeats)
        )
        cells[b] = progress("transformers", b, Cell(best, b * (output_len - 1)))
    del model
    return cells


def _hf_seconds(model, ids, new_tokens: int) -> float:
    import torch

    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        # eos_token_id=None: never stop early, like ignore_eos (min_new_tokens would add a
        # logits processor to every step)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        sync()
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens, "transformers stopped early"
    return elapsed
