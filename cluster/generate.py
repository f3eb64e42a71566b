"""`raylane generate`: offline generation with the engine (the embedded model by default)."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "List three prime numbers.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        dest="prompts",
        metavar="TEXT",
        help="a user message; repeat for several (default: a few demo questions)",
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as plain text instead of through the chat template",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ModelShard Ray actors (starts a local Ray "
        "unless RAY_ADDRESS is set); N must divide the attention heads",
    )


def run(args: argparse.Namespace) -> int:
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
    from raylane.models import default_model_path

    engine = LLMEngine(
        EngineConfig(
            model=args.model or default_model_path(),
            dtype=args.dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = args.prompts or DEFAULT_PROMPTS
    start = time.perf_counter()
    if args.raw:
        outs = engine.generate(prompts, params)
    else:
        outs = engine.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    for prompt, out in zip(prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"\n{len(outs)} requests, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s)"
    )
    return 0
