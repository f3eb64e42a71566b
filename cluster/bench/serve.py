"""`raylane bench serve`: streaming clients against the HTTP endpoint, with references.

Runs a fixed seeded chat workload through N concurrent streaming clients and reports
requests/s, output tokens/s, TTFT and inter-token latency. In the same run it measures the
offline engine on the same prompts (the ceiling the HTTP path should keep 85% of) and,
with `--transformers`, `transformers serve --continuous-batching` on the same model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

WORDS = ("river mountain quiet engine yellow garden rocket winter harbor pencil ocean copper "
         "violin forest silver planet window market candle thunder").split()


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    requests: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running endpoint (default: start one in-process)")
    parser.add_argument("--model", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-offline", action="store_true", help="skip the offline engine")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads of the engine replica (default: all cores)")
    parser.add_argument("--serve-proxy", action="store_true",
                        help="the in-process endpoint answers through Ray Serve's proxy "
                             "(`raylane serve --no-direct-ingress`) instead of its ingress "
                             "replica's own HTTP server")
    parser.add_argument("--transformers", action="store_true",
                        help="also run `transformers serve --continuous-batching` as a reference")


def make_workload(num: int, max_tokens: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"Write about: {' '.join(rng.choices(WORDS, k=rng.randint(3, 40)))}.",
             rng.randint(*max_tokens)) for _ in range(num)]


async def _one(session, url: str, model: str, prompt: str, max_tokens: int, result: RunResult):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
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
                (result.ttft if chunks == 0 else result.itl).append(now - (start if chunks == 0
                                                                          else last))
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
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while queue:
                prompt, max_tokens = queue.pop()
                await _one(session, url, model, prompt, max_tokens, result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        result.wall_s = time.perf_counter() - start
    return result


def warm_up_work(args: argparse.Namespace) -> list[tuple[str, int]]:
    """An untimed pass before each measured one, of the same shape with other words: a fresh
    server's (and engine's) first steps pay one-time costs, e.g. oneDNN compiling a kernel for
    each new batch shape, that the measured runs should not."""
    return make_workload(args.requests, tuple(args.max_tokens), seed=args.seed + 1)


def run_offline(model_dir: str, work: list[tuple[str, int]], warm: list[tuple[str, int]],
                concurrency: int) -> RunResult:
    """The same requests through LLMEngine.generate, at most `concurrency` running at once
    (after the `warm` pass)."""
    from actors.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=concurrency))

    def requests(work: list[tuple[str, int]]) -> tuple[list, list[SamplingParams]]:
        prompts = [engine.validator.render_chat([{"role": "user", "content": p}])
                   for p, _ in work]
        return prompts, [SamplingParams(temperature=0, max_tokens=n) for _, n in work]

    engine.generate(*requests(warm), use_tqdm=False)
    start = time.perf_counter()
    outs = engine.generate(*requests(work), use_tqdm=False)
    wall = time.perf_counter() - start
    return RunResult(wall, sum(len(o.outputs[0].token_ids) for o in outs), len(work))


def run(args: argparse.Namespace) -> int:
    from cluster.bench.serve_targets import raylane_endpoint, transformers_endpoint
    from cluster.models import resolve_model

    model_dir = resolve_model(args.model)
    work = make_workload(args.requests, tuple(args.max_tokens), args.seed)
    offline = None
    if not args.skip_offline:  # first, on a quiet machine: Ray's processes linger after it
        offline = run_offline(model_dir, work, warm_up_work(args), args.clients)
    rows: list[tuple[str, RunResult]] = []
    with raylane_endpoint(args.url, model_dir, args.torch_threads,
                          False if args.serve_proxy else None) as (url, name):
        asyncio.run(drive(url, name, warm_up_work(args), args.clients))
        how = ", Serve's proxy" if args.serve_proxy else ""
        rows.append((f"raylane HTTP ({args.clients} clients{how})",
                     asyncio.run(drive(url, name, work, args.clients))))
    if offline is not None:
        rows.append((f"raylane offline LLMEngine (max_num_seqs={args.clients})", offline))
    if args.transformers:
        with transformers_endpoint(model_dir) as (url, name):
            asyncio.run(drive(url, name, warm_up_work(args), args.clients))
            rows.append((f"transformers serve --cb ({args.clients} clients)",
                         asyncio.run(drive(url, name, work, args.clients))))
    print_table(rows, len(work))
    return 0


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1e3:.0f}"


def print_table(rows: list[tuple[str, RunResult]], num: int) -> None:
    base = rows[0][1].output_tokens / rows[0][1].wall_s
    print(f"\nworkload: {num} chat requests, greedy, float32")
    print("| system | req/s | output tok/s | raylane HTTP / this | TTFT p50 ms | TTFT p99 ms "
          "| ITL p50 ms | ITL p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        tps = r.output_tokens / r.wall_s
        print(f"| {name} | {r.requests / r.wall_s:.2f} | {tps:.1f} | {base / tps:.2f} | "
              f"{_pct(r.ttft, 0.5)} | {_pct(r.ttft, 0.99)} | {_pct(r.itl, 0.5)} | "
              f"{_pct(r.itl, 0.99)} | {r.errors} |")
    if len(rows) > 1 and rows[1][0].startswith("raylane offline"):
        off = rows[1][1].output_tokens / rows[1][1].wall_s
        print(f"\nHTTP keeps {100 * base / off:.0f}% of the offline engine's output tok/s")
