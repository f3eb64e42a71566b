"""`raylane bench weights`' pause("keep") -> update -> resume run, with requests in flight, and
the check that each request's per-token weight versions switch once, at the update."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class PauseRun:
    name: str
    pause_s: float
    update_s: float
    resume_s: float
    spanning: int  # requests whose tokens switch version once, at the update
    finished: int


async def pause_update_resume(
    make, url: str, named: list, version: int, bucket: int, in_flight: int, name: str
) -> PauseRun:
    """`in_flight` requests generating; then pause("keep") -> update -> resume, timed."""
    async with make() as client:
        prompts = [[1 + (31 * i + j) % 1000 for j in range(16 + i % 8)] for i in range(in_flight)]
        tasks = [
            asyncio.ensure_future(
                client.generate(p, temperature=0.0, max_tokens=96, ignore_eos=True, logprobs=None)
            )
            for p in prompts
        ]
        await decoding(url, in_flight)
        t0 = time.perf_counter()
        await client.pause("keep")
        t1 = time.perf_counter()
        await client.update_weights(named, version, bucket, progress=True)
        t2 = time.perf_counter()
        await client.resume()
        t3 = time.perf_counter()
        outs = [o[0] for o in await asyncio.gather(*tasks)]
    spanning = sum(_switches_once(o.weight_versions, version) for o in outs)
    return PauseRun(
        name, t1 - t0, t2 - t1, t3 - t2, spanning, sum(o.finish_reason == "length" for o in outs)
    )


async def decoding(url: str, num: int, timeout_s: float = 300.0) -> None:
    """Wait until `num` requests run, none waits, and each made a few tokens (/metrics)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        start = _metric((await http.get("/metrics")).text, "raylane:generation_tokens")
        while time.monotonic() < deadline:
            text = (await http.get("/metrics")).text
            if (
                _metric(text, "raylane:num_requests_running") == num
                and _metric(text, "raylane:num_requests_waiting") == 0
                and _metric(text, "raylane:generation_tokens") >= start + 3 * num
            ):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{num} requests were not all decoding within {timeout_s:.0f} s")


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus family's samples (counters by their _total sample)."""
    names = (name, name + "_total")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] in names
    )


def _switches_once(versions: list[int], new: int) -> bool:
    """Old version up to some token, the new one from there on."""
    if new not in versions or versions[0] == new:
        return False
    cut = versions.index(new)
    return len(set(versions[:cut])) == 1 and set(versions[cut:]) == {new}
