"""`python -m benchmarks spec-step`: one decode step against one verify step at batch 1, part
by part.

A verify row (the last token and k drafts) is a prefill-like chunk of 1 + k query tokens; a
decode row is one token on the decode path. This times, on the runner's own objects and in
alternation (so a load on the machine hits both alike), each part a step of either kind
runs: input preparation, the model's forward (the layers; the decode row also as a 1-token
chunk, which isolates the attention path), the logits, the sampler with logprobs on 1 vs
1 + k rows, and the drafter's host work (n-gram lookup, suffix index update and lookup) on
the copy workload's tokens. Each part reports the median wall time and the median CPU time
of the process (robust to other load; with several torch threads it includes their spinning).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=200, help="tokens before the step")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")


def run(args: argparse.Namespace) -> int:
    import torch
    from raylane.actors.engine import EngineConfig, LLMEngine
    from raylane.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=resolve_model(args.model), dtype="float32"))
    try:
        parts = step_parts(engine, args.num_speculative_tokens, args.context_len)
        rows = time_parts(parts, args.iterations)
    finally:
        engine.shutdown()
    k = args.num_speculative_tokens
    print(f"| part | decode (T=1) ms | verify (T=1+{k}) ms | verify / decode (cpu) |")
    print("|---|---|---|---|")
    for name, (decode, verify) in rows.items():
        if name.startswith("drafter"):  # host work only a drafting step does
            print(f"| {name} | - | {_cell(verify)} | - |")
            continue
        print(f"| {name} | {_cell(decode)} | {_cell(verify)} | {verify[1] / decode[1]:.2f}x |")
    return 0


def _cell(times: tuple[float, float]) -> str:
    wall, cpu = times
    return f"{1000 * wall:.2f} (cpu {1000 * cpu:.2f})"


def step_parts(engine, k: int, context_len: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (the decode row's part, the verify row's part), as thunks."""
    import torch
    from raylane.actors.engine import SamplingParams
    from raylane.actors.engine.spec.ngram import NgramProposer
    from raylane.actors.engine.spec.suffix import SuffixIndex
    from raylane.actors.runner.requests import RequestState, ScheduledRequest
    from raylane.bench.spec import copy_prompts

    runner = engine.executor.runner
    tokens = (copy_prompts(engine.tokenizer, 1, 3)[0] * 8)[:context_len]
    blocks = list(range(1, 2 + context_len // runner.config.block_size + 1))
    params = SamplingParams(temperature=0.0, logprobs=1)
    state = RequestState(0, 0, tokens[:-1], blocks, context_len - 1, params)
    state.token_ids.append(tokens[-1])
    drafts = tuple(tokens[1 : 1 + k])
    decode = ScheduledRequest(state, 1)
    verify = ScheduledRequest(state, 1 + k, drafts)
    prep = runner.inputs.prepare
    inputs = {"decode": prep([decode], 0), "chunk": prep([decode], 1), "verify": prep([verify], 1)}
    model = runner.model

    def forward(name: str) -> Callable:
        step = inputs[name]
        return lambda: model(step.input_ids, step.positions, step.attn)

    hidden = {n: forward(n)()[0] for n in inputs}

    def logits(name: str) -> Callable:
        rows = hidden[name].index_select(0, inputs[name].logits_indices)
        return lambda: model.compute_logits(rows)

    one, many = logits("decode")(), logits("verify")()
    states = [state] * (1 + k)
    ngram, suffix = NgramProposer(2, 4), SuffixIndex()
    suffix.add(0, tokens, len(tokens))
    grown = list(tokens)
    suffix.add(1, grown, len(tokens))

    def suffix_step() -> None:
        grown.append(tokens[len(grown) % len(tokens)])  # one new token, indexed, then a lookup
        suffix.propose(1, k)

    with torch.inference_mode():
        return {
            "input preparation": (lambda: prep([decode], 0), lambda: prep([verify], 1)),
            # the same row, as a decode row and as a 1-token chunk: the attention paths
            "forward, T=1 as a chunk (verify path)": (forward("decode"), forward("chunk")),
            "forward (layers)": (forward("decode"), forward("verify")),
            "logits": (logits("decode"), logits("verify")),
            "sampling + logprobs": (
                lambda: runner.sampler(one, [state]),
                lambda: runner.sampler(many, states),
            ),
            "drafter: n-gram lookup": (lambda: None, lambda: ngram.propose(tokens, k)),
            "drafter: suffix update + lookup": (lambda: None, suffix_step),
        }


def time_parts(
    parts: dict[str, tuple[Callable, Callable]], iterations: int
) -> dict[str, tuple[tuple[float, float], tuple[float, float]]]:
    """Median (wall, cpu) seconds of each thunk, the two of a part run in alternation."""
    import torch

    out = {}
    with torch.inference_mode():
        for name, pair in parts.items():
            samples: list[list[tuple[float, float]]] = [[], []]
            for _ in range(iterations):
                for i, thunk in enumerate(pair):
                    wall, cpu = time.perf_counter(), time.process_time()
                    thunk()
                    samples[i].append((time.perf_counter() - wall, time.process_time() - cpu))
            a, b = (
                (statistics.median(s[0] for s in xs), statistics.median(s[1] for s in xs))
                for xs in samples
            )
            out[name] = (a, b)
    return out
