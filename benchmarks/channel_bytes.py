"""`python -m benchmarks channel-bytes`: what an engine replica's output channel ships to its
caller per token, on `raylane bench serve`'s workload (its first round's prompts).

Runs a workload through an `AsyncLLMEngine` and the replica's own `OutputChannel` in this
process and pickles every batch the channel yields, as Ray does to send it (pickle protocol 5);
no Ray process is started. The figure that matters is bytes per output token: with the engine's
deltas it stays O(1) per token whatever the prompt length (the prompt travels once).
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
from dataclasses import dataclass


@dataclass
class ChannelBytes:
    bytes: int = 0
    messages: int = 0  # batches: one per engine step with news
    output_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0

    @property
    def per_token(self) -> float:
        return self.bytes / max(1, self.output_tokens)

    @property
    def per_message(self) -> float:
        return self.bytes / max(1, self.messages)

    def add(self, batch: list) -> None:
        self.bytes += len(pickle.dumps(batch, protocol=5))
        self.messages += 1
        for _, item in batch:
            if not isinstance(item, BaseException):
                self.output_tokens += sum(len(c.token_ids) for c in item.outputs)
                self.requests += bool(item.finished)


def measure(model_dir: str, work: list[tuple[str, int]], seqs: int) -> ChannelBytes:
    """`ChannelBytes` of the chat workload (user message, max_tokens) run greedy, `seqs` at a
    time on the engine."""
    from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=seqs))
    prompts = [engine.validator.render_chat([{"role": "user", "content": p}]) for p, _ in work]
    try:
        return asyncio.run(_run(AsyncLLMEngine(engine), prompts, [n for _, n in work]))
    finally:
        engine.shutdown()


async def _run(engine, prompts: list[list[int]], max_tokens: list[int]) -> ChannelBytes:
    from raylane.actors.engine import SamplingParams
    from raylane.actors.output_channel import OutputChannel

    channel, result = OutputChannel(), ChannelBytes()
    result.prompt_tokens = sum(len(p) for p in prompts)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        channel.start(await engine.add_request(prompt, params, f"b{i}"))
    async for batch in channel.batches():
        result.add(batch)
        if result.requests == len(prompts):
            break
    channel.close()
    await engine.shutdown()
    return result


def report(label: str, r: ChannelBytes) -> str:
    return (
        f"| {label} | {r.prompt_tokens / max(1, r.requests):.0f} | {r.output_tokens} "
        f"| {r.messages} | {r.per_message:.0f} | {r.per_token:.1f} |"
    )


HEADER = (
    "| workload | prompt tokens (mean) | output tokens | channel messages | bytes/message "
    "| bytes/output token |\n|---|---|---|---|---|---|"
)


def print_channel_bytes(model_dir: str, work: list[tuple[str, int]], clients: int) -> None:
    """One workload's bytes, as a table."""
    print("\nreplica -> ingress output channel (pickled as Ray sends it):")
    print(HEADER)
    label = f"{len(work)} chat requests, {clients} at a time"
    print(report(label, measure(model_dir, work, clients)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`raylane bench serve`'s workload options, the same defaults."""
    parser.add_argument("--model", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--clients", type=int, default=32, help="requests at a time")
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--prompt-words", type=int, nargs=2, default=[3, 40], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from raylane.bench.serve import round_work
    from raylane.models import resolve_model

    print_channel_bytes(resolve_model(args.model), round_work(args, 0)[0], args.clients)
    return 0
