r"""Dump `raylane bench spec`'s workloads (prompts as token ids, sampling params) to JSON.

The prompts come from raylane's own builder (`raylane.bench.spec.workload`) with the model's own
tokenizer, so `vllm_spec.py` sends vLLM exactly the prompts `raylane bench spec` measures.
Run with raylane's venv, from the repository root:

    .venv/bin/python benchmarks/peers/spec_workloads.py --out /tmp/spec_workloads.json \
        --workloads copy,random --batch-sizes 1,4

The JSON also names the model's HF directory (the embedded SmolLM2's converted directory
unless --model is given), which vLLM loads. Not a test: pytest never collects benchmarks/.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

# what vLLM's SamplingParams takes of raylane's, for these workloads
FIELDS = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos")


def cells(model_dir: str, workloads: list[str], batches: list[int], output_len: int) -> list:
    from raylane.actors.models import load_tokenizer
    from raylane.bench.spec import workload
    from transformers import AutoConfig

    tokenizer = load_tokenizer(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    out = []
    for name in workloads:
        for batch in batches:
            prompts, params = workload(name, tokenizer, batch, output_len, vocab)
            sampling = [{k: asdict(p)[k] for k in FIELDS} for p in params]
            out.append({"workload": name, "batch": batch, "prompts": prompts, "params": sampling})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--model", help="HF directory or .gguf (default: the embedded SmolLM2's)")
    parser.add_argument("--workloads", default="copy,random", metavar="W[,W...]")
    parser.add_argument("--batch-sizes", default="1,4", metavar="N[,N...]")
    parser.add_argument("--output-len", type=int, default=96)
    args = parser.parse_args()
    from raylane.actors.models import resolve_model_dir
    from raylane.models import resolve_model

    model_dir = resolve_model_dir(resolve_model(args.model))  # vLLM needs the HF directory
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dump = {
        "model_dir": model_dir,
        "output_len": args.output_len,
        "cells": cells(model_dir, args.workloads.split(","), batches, args.output_len),
    }
    with open(args.out, "w") as f:
        json.dump(dump, f)
    print(f"wrote {len(dump['cells'])} cells to {args.out} (model {model_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
