"""`raylane bench serve`'s load: a seeded chat workload, driven through N concurrent streaming
clients that time each request's first token (TTFT) and the gaps after it (ITL)."""

from __future__ import annotations

import asyncio
import json
import random
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
