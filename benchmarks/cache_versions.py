"""`python -m benchmarks cache-versions`: two ways to keep the prefix cache from serving KV computed
under old weights, timed on a full cache at an update.

- fold: every hash chain starts from the weight version its sequence was admitted under (what
  the engine does): the update bumps a number; old chains stop matching and age out as their
  blocks are reused.
- flush: the update drops every cached hash (`BlockManager.reset_prefix_cache`).
- none: the hazard both prevent, for reference: every prompt hits KV of the old weights.

For each: the cost of the update itself, prefix hits right after it (must be 0: any hit would
be stale KV), the time to prefill the same prompts again, and hits on a second pass under the
new version (the cache works again).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.sequence import Sequence

POLICIES = ("fold", "flush", "none")


@dataclass
class CacheRow:
    policy: str
    update_us: float
    stale_hits: int  # prompt tokens found right after the update
    refill_ms: float  # the same prompts prefilled again (blocks allocated, chains committed)
    hits_after: int  # tokens found on a second pass under the new version
    blocks: int


def measure(
    policy: str, num_prompts: int = 64, prompt_blocks: int = 64, block_size: int = 16
) -> CacheRow:
    bm = BlockManager(num_prompts * prompt_blocks, block_size)
    prompts = [
        [p * 100_000 + t for t in range(prompt_blocks * block_size)] for p in range(num_prompts)
    ]
    _prefill_all(bm, prompts, block_size)
    start = time.perf_counter()
    if policy == "fold":
        bm.version += 1
    elif policy == "flush":
        bm.reset_prefix_cache()
    update_us = 1e6 * (time.perf_counter() - start)
    start = time.perf_counter()
    stale = _prefill_all(bm, prompts, block_size)
    refill_ms = 1e3 * (time.perf_counter() - start)
    again = _prefill_all(bm, prompts, block_size)
    return CacheRow(policy, update_us, stale, refill_ms, again, bm.num_blocks)


def _prefill_all(bm: BlockManager, prompts: list[list[int]], block_size: int) -> int:
    """Prefill each prompt as the engine would (look up, allocate, commit), then finish it
    (its blocks stay cached); the prompt tokens found in the cache."""
    hits = 0
    for tokens in prompts:
        seq = Sequence("bench", 0, tokens, SamplingParams(), block_size)
        seq.cache_version = bm.version  # what the scheduler sets on admission
        cached = bm.allocate_cached_prefix(seq)
        hits += cached
        seq.num_computed_tokens = cached
        bm.allocate(seq, len(seq) - cached)
        seq.num_computed_tokens = len(seq)
        bm.commit_full_blocks(seq)
        bm.free_sequence(seq)
    return hits


def print_cache_table(rows: list[CacheRow]) -> None:
    print(
        f"\nprefix cache at an update, {rows[0].blocks} cached blocks of 16 tokens (none: no "
        "protection, for reference):"
    )
    print(
        f"| {'policy':<6} | {'update us':>9} | {'stale hits':>10} | {'refill ms':>9} | "
        f"{'hits after':>10} |"
    )
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 12}|{'-' * 11}|{'-' * 12}|")
    for r in rows:
        print(
            f"| {r.policy:<6} | {r.update_us:>9.1f} | {r.stale_hits:>10} | "
            f"{r.refill_ms:>9.1f} | {r.hits_after:>10} |"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: 64 prompts of 64 blocks of 16 tokens, on the BlockManager alone."""


def run(args: argparse.Namespace) -> int:
    print_cache_table([measure(policy) for policy in POLICIES])
    return 0
