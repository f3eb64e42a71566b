"""`raylane bench spec`: decode tok/s without speculation and with each method, same run.

Workloads (each at every `--batch-sizes` value, in sequences):
- copy: the answer repeats the prompt (chat: "repeat this text, fixing the typos", a text of
  ~110 tokens), greedy;
- group: RL groups, `n=8` sampled answers (temperature 0.7, seeded) of one prompt per group;
- random: random-token prompts continued by sampling at temperature 1 (nothing to predict).

Each cell runs the batch to `--output-len` tokens (ignore_eos) on engines that differ only in
`speculative_config`, in alternating order, the best of `--repeats`; tok/s counts output tokens
over the whole `generate` (prompts are short next to the output). Outputs are checked equal to
the run without speculation (greedy and seeded: they must be).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

METHODS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
TEXTS = [
    "The river runs past the old mill, where the miller's children once played among the "
    "sacks of flour. Today the wheel is still, and moss grows on the stones of the weir.",
    "To install the package, open a terminal, create a virtual environment, activate it, and "
    "run pip install with the name of the package. Then import it in your script.",
    "Our meeting is moved to Thursday at three o'clock in the small conference room. Please "
    "bring the quarterly figures and the draft of the new budget for the design team.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens "
    "in the chloroplasts of plant cells, which hold the green pigment chlorophyll.",
    "The train leaves the central station at seven fifteen and arrives in the harbour town "
    "just after ten, stopping at every village along the coast on the way there.",
    "A good password is long, hard to guess and used for one account only. A password "
    "manager can create and remember such passwords for every site you use.",
]


@dataclass
class Cell:
    workload: str
    batch: int
    method: str
    tok_s: float
    tokens: int
    acceptance: float | None = None  # accepted / draft tokens
    mean_accepted: float | None = None  # tokens per verify row (accepted + 1)
    steps: int = 0  # engine steps (tok/s = tokens / steps / step time)
    seconds: float = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--batch-sizes", default="1,4,16,32", metavar="N[,N...]")
    parser.add_argument("--workloads", default="copy,group,random", metavar="W[,W...]")
    parser.add_argument(
        "--methods",
        default="off,ngram,suffix",
        metavar="M[,M...]",
        help="off, ngram, suffix, draft (needs --draft-model), mtp (a model with MTP weights)",
    )
    parser.add_argument("--draft-model", help="method 'draft': the draft model's HF directory")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="k, the drafts per step, of every method (default 4)",
    )
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")


def spec_of(method: str, args: argparse.Namespace) -> dict | None:
    """The speculative_config of a `--methods` entry."""
    k = args.num_speculative_tokens
    if method == "draft":
        return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k}
    spec = METHODS[method]
    return None if spec is None else {**spec, "num_speculative_tokens": k}


def copy_prompts(tokenizer, batch: int, texts_per_prompt: int = 1) -> list[list[int]]:
    """Chat prompts asking to repeat `texts_per_prompt` of TEXTS (about 35 tokens each) with
    two typos fixed. The copy workload joins three, so the answer (SmolLM2 repeats them,
    with small edits, in ~100 tokens) covers the 96 tokens measured: with one, the answer
    ended after ~40 tokens and the rest (ignore_eos) was free text, nothing to copy."""
    prompts = []
    for i in range(batch):
        text = " ".join(TEXTS[(i + j) % len(TEXTS)] for j in range(texts_per_prompt))
        text = text.replace("the", "teh", 1).replace("and", "adn", 1)
        messages = [
            {
                "role": "user",
                "content": f"Repeat this text exactly, fixing only the spelling mistakes:\n\n"
                f"{text}",
            }
        ]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]


def workload(name: str, tokenizer, batch: int, output_len: int, vocab: int):
    """(prompts, params list) of `batch` sequences."""
    from raylane.actors.engine import SamplingParams

    if name == "copy":
        greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        return copy_prompts(tokenizer, batch, texts_per_prompt=3), [greedy] * batch
    if name == "group":
        groups = max(1, batch // 8)
        prompts = copy_prompts(tokenizer, groups)
        params = [
            SamplingParams(
                n=min(8, batch), temperature=0.7, seed=g, max_tokens=output_len, ignore_eos=True
            )
            for g in range(groups)
        ]
        return prompts, params
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(batch)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True)
        for i in range(batch)
    ]
    return prompts, params


def run(args: argparse.Namespace) -> int:
    import torch
    from raylane.actors.engine import EngineConfig, LLMEngine
    from raylane.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    methods = args.methods.split(",")
    engines = {
        m: LLMEngine(
            EngineConfig(model=model, dtype="float32", speculative_config=spec_of(m, args))
        )
        for m in methods
    }
    cells: list[Cell] = []
    try:
        first = engines[methods[0]]
        vocab = first.validator.vocab_size
        for name in args.workloads.split(","):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                prompts, params = workload(name, first.tokenizer, batch, args.output_len, vocab)
                cells += measure(engines, name, batch, prompts, params, args.repeats)
                print_table(cells[-len(methods) :], header=not cells[: -len(methods)])
    finally:
        for engine in engines.values():
            engine.shutdown()
    return 0


def measure(engines, name: str, batch: int, prompts, params, repeats: int) -> list[Cell]:
    best: dict[str, Cell] = {}
    outputs: dict[str, list] = {}
    for engine in engines.values():  # warm: shapes, and the grouped prompt's prefix
        engine.generate(prompts, params, use_tqdm=False)
    for _ in range(repeats):
        for method, engine in engines.items():
            spec = engine.stats.spec
            before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts)
            steps = engine.stats.step_times.steps
            start = time.perf_counter()
            outs = engine.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            cell = Cell(name, batch, method, tokens / seconds, tokens)
            cell.steps, cell.seconds = engine.stats.step_times.steps - steps, seconds
            drafted = spec.num_draft_tokens - before[0]
            if drafted:
                accepted = spec.num_accepted_tokens - before[1]
                cell.acceptance = accepted / drafted
                cell.mean_accepted = 1 + accepted / (spec.num_drafts - before[2])
            outputs[method] = [c.token_ids for o in outs for c in o.outputs]
            if method not in best or cell.tok_s > best[method].tok_s:
                best[method] = cell
    reference = next(iter(outputs.values()))
    for method, token_ids in outputs.items():
        if token_ids != reference:
            raise RuntimeError(f"{method} changed the output of workload {name} at batch {batch}")
    return list(best.values())


def print_table(cells: list[Cell], header: bool) -> None:
    if header:
        print(
            "| workload | batch | method | tok/s | vs off | acceptance | mean accepted len "
            "| steps | ms/step |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    base = cells[0].tok_s
    for c in cells:
        acc = "-" if c.acceptance is None else f"{c.acceptance:.0%}"
        mal = "-" if c.mean_accepted is None else f"{c.mean_accepted:.2f}"
        print(
            f"| {c.workload} | {c.batch} | {c.method} | {c.tok_s:.1f} | "
            f"{c.tok_s / base:.2f}x | {acc} | {mal} | {c.steps} | "
            f"{1000 * c.seconds / max(1, c.steps):.1f} |",
            flush=True,
        )
