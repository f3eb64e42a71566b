"""`raylane bench serve`: streaming clients against the HTTP endpoint, with references.

Runs a fixed seeded chat workload through N concurrent streaming clients and reports
requests/s, output tokens/s, TTFT and inter-token latency. In the same run it measures the
offline engine on the same prompts (the ceiling the HTTP path should keep 85% of) and,
with `--transformers`, `transformers serve --continuous-batching` on the same model.
`--prompt-words` makes the prompts long; `--channel-bytes` adds the bytes per output token that
the replica's output channel sends to the ingress (raylane/bench/channel_bytes.py).

The HTTP/offline ratio is taken in paired rounds (`--rounds`): each round runs the offline
engine, then a fresh endpoint, on that round's own workload, one right after the other. These
machines' speed drifts by more than 10% within minutes (other tenants), so a ratio of two runs
minutes apart measures the drift as much as the serving path; the median of paired rounds does
not. Offline runs only while no Ray process is up: an idle local cluster alone slows the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

WORDS = (
    "river mountain quiet engine yellow garden rocket winter harbor pencil ocean copper "
    "violin forest silver planet window market candle thunder"
).split()


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    requests: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_s: float = 0.0  # the offline engine's process time over the run

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running endpoint (default: start one in-process)")
    parser.add_argument("--model", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--prompt-words",
        type=int,
        nargs=2,
        default=[3, 40],
        metavar=("MIN", "MAX"),
        help="words per prompt (long prompts: e.g. 2000 2000, about 2 tokens a word)",
    )
    parser.add_argument(
        "--channel-bytes",
        action="store_true",
        help="also measure the bytes the replica's output channel sends per output token "
        "(round 1's workload, in process, before any Ray process starts)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="paired rounds (offline engine, then a fresh endpoint, each on the "
        "round's own workload); the ratio reported is their median",
    )
    parser.add_argument("--skip-offline", action="store_true", help="skip the offline engine")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads of the engine replica (default: all cores)",
    )
    parser.add_argument(
        "--serve-proxy",
        action="store_true",
        help="the in-process endpoint answers through Ray Serve's proxy "
        "(`raylane serve --no-direct-ingress`) instead of its ingress "
        "replica's own HTTP server",
    )
    parser.add_argument(
        "--cpu-by-process",
        action="store_true",
        help="also report CPU seconds per process of the bench's own endpoint over the timed "
        "passes (raylane/bench/process_cpu.py)",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also run `transformers serve --continuous-batching` as a reference",
    )


def make_workload(
    num: int, max_tokens: tuple[int, int], seed: int, words: tuple[int, int] = (3, 40)
) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [
        (
            f"Write about: {' '.join(rng.choices(WORDS, k=rng.randint(*words)))}.",
            rng.randint(*max_tokens),
        )
        for _ in range(num)
    ]


async def _one(session, url: str, model: str, prompt: str, max_tokens: int, result: RunResult):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    chunks, usage = 0, None
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            result.errors += 1
            return
        async for raw in resp.content:  # one line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                now = time.perf_counter()
                (result.ttft if chunks == 0 else result.itl).append(
                    now - (start if chunks == 0 else last)
                )
                last, chunks = now, chunks + 1
    result.output_tokens += usage["completion_tokens"] if usage else chunks


async def drive(url: str, model: str, work: list[tuple[str, int]], clients: int) -> RunResult:
    """`clients` concurrent streaming clients over `work`. aiohttp, as `vllm bench serve`:
    on 2 cores the client shares the CPU with the server, and httpx took half again as much
    of it (3% of one core against 2%)."""
    import aiohttp

    result = RunResult(0.0, 0, len(work))
    queue = list(reversed(work))
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:

        async def worker():
            while queue:
                prompt, max_tokens = queue.pop()
                await _one(session, url, model, prompt, max_tokens, result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        result.wall_s = time.perf_counter() - start
    return result


class OfflineEngine:
    """The same requests through LLMEngine.generate, at most `concurrency` running at once. Built
    and warmed once (`warm`), before any Ray process starts."""

    def __init__(self, model_dir: str, concurrency: int, warm: list[tuple[str, int]]):
        from raylane.actors.engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=concurrency))
        self.run(warm)

    def run(self, work: list[tuple[str, int]]) -> RunResult:
        from raylane.actors.engine import SamplingParams

        prompts = [
            self.engine.validator.render_chat([{"role": "user", "content": p}]) for p, _ in work
        ]
        params = [SamplingParams(temperature=0, max_tokens=n) for _, n in work]
        start, cpu = time.perf_counter(), time.process_time()
        outs = self.engine.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return RunResult(wall, tokens, len(work), cpu_s=cpu)


def round_work(args: argparse.Namespace, k: int) -> tuple[list, list]:
    """Round k's measured workload and its untimed warm-up pass (the same shape, other words):
    a fresh server's (and engine's) first steps pay one-time costs, e.g. oneDNN compiling a
    kernel for each new batch shape, that the measured runs should not. Fresh prompts every
    round, so neither system answers from a prefix cache an earlier round filled."""
    seed = args.seed + 2 * k
    size, words = (args.requests, tuple(args.max_tokens)), tuple(args.prompt_words)
    return make_workload(*size, seed, words), make_workload(*size, seed + 1, words)


def run(args: argparse.Namespace) -> int:
    import psutil
    from raylane.bench.process_cpu import ProcessCpu
    from raylane.bench.serve_targets import raylane_endpoint, transformers_endpoint
    from raylane.models import resolve_model

    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    model_dir = resolve_model(args.model)
    if args.channel_bytes:
        from raylane.bench.channel_bytes import print_channel_bytes

        print_channel_bytes(model_dir, round_work(args, 0)[0], args.clients)
    offline = None
    if not args.skip_offline:
        offline = OfflineEngine(model_dir, args.clients, round_work(args, 0)[1])
    cpu = ProcessCpu()
    how = ", Serve's proxy" if args.serve_proxy else ""
    http = Rows(f"raylane HTTP ({args.clients} clients{how})")
    off = Rows(f"raylane offline LLMEngine (max_num_seqs={args.clients})")
    for k in range(args.rounds):
        work, warm = round_work(args, k)
        if offline is not None:
            off.runs.append(offline.run(work))
        with raylane_endpoint(
            args.url, model_dir, args.torch_threads, False if args.serve_proxy else None
        ) as (url, name):
            started = psutil.Process().children(recursive=True)
            asyncio.run(drive(url, name, warm, args.clients))
            with cpu.timed():
                http.runs.append(asyncio.run(drive(url, name, work, args.clients)))
        # the next offline run shares the CPU with none of Ray's processes
        psutil.wait_procs(started, timeout=60)
        print(
            f"round {k + 1}/{args.rounds}: HTTP {http.runs[-1].tok_s:.1f} tok/s"
            + (f", offline {off.runs[-1].tok_s:.1f}" if off.runs else ""),
            flush=True,
        )
    rows = [http] + ([off] if off.runs else [])
    if args.transformers:
        work, warm = round_work(args, 0)
        ref = Rows(f"transformers serve --cb ({args.clients} clients)")
        with transformers_endpoint(model_dir) as (url, name):
            asyncio.run(drive(url, name, warm, args.clients))
            ref.runs.append(asyncio.run(drive(url, name, work, args.clients)))
        rows.append(ref)
    print_table(rows, args.requests)
    if args.cpu_by_process:
        print(cpu.table(sum(r.output_tokens for r in http.runs), off.runs))
    return 0


@dataclass
class Rows:
    """One system's runs, one per round."""

    name: str
    runs: list[RunResult] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.runs)

    def pooled(self, attr: str) -> list[float]:
        return [x for r in self.runs for x in getattr(r, attr)]


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.0f}"


def print_table(rows: list[Rows], num: int) -> None:
    http = rows[0]
    rounds = len(http.runs)
    print(
        f"\nworkload: {num} chat requests per round, greedy, float32; {rounds} round(s), "
        "output tok/s and req/s: median over rounds, latencies: pooled"
    )
    print(
        "| system | req/s | output tok/s | per round | raylane HTTP / this | TTFT p50 ms "
        "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        req_s = statistics.median(r.requests / r.wall_s for r in row.runs)
        per_round = " ".join(f"{r.tok_s:.1f}" for r in row.runs)
        ttft, itl = row.pooled("ttft"), row.pooled("itl")
        print(
            f"| {row.name} | {req_s:.2f} | {row.tok_s:.1f} | {per_round} | "
            f"{http.tok_s / row.tok_s:.2f} | {_pct(ttft, 0.5)} | {_pct(ttft, 0.99)} | "
            f"{_pct(itl, 0.5)} | {_pct(itl, 0.99)} | {sum(r.errors for r in row.runs)} |"
        )
    if len(rows) > 1 and rows[1].name.startswith("raylane offline"):
        ratios = [h.tok_s / o.tok_s for h, o in zip(http.runs, rows[1].runs)]
        each = ", ".join(f"{100 * x:.0f}%" for x in ratios)
        print(
            f"\nHTTP keeps {100 * statistics.median(ratios):.0f}% of the offline engine's "
            f"output tok/s (median of {rounds} paired round(s): {each})"
        )
