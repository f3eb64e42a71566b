"""Fan-out and aggregation for graph-of-thought style rollouts: branches and the k best.

A `Branch` is one generation running as a task; `RolloutClient.fork` starts k of them on one
prefix, `release` frees one at once, `gather` collects them (see the client for the cluster
side). `aggregate` picks the inputs of an aggregation step from scored proposals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from raylane.client.rollout import Rollout

T = TypeVar("T")


@dataclass(eq=False)
class Branch:
    index: int
    request_id: str
    prompt: list[int] | str
    task: asyncio.Task[list[Rollout]] = field(repr=False)
    released: bool = False

    def done(self) -> bool:
        return self.task.done()

    async def result(self) -> Rollout:
        """The branch's sample (waits for it); CancelledError once released."""
        return (await self.task)[0]


def branch_prompts(
    prefix: list[int] | str, k: int, suffixes: Sequence[list[int] | str] | None, sampling: dict
) -> list[list[int] | str]:
    """The k branches' prompts (`prefix` + `suffixes[i]` when given); a ValueError for a bad
    k, a suffix count other than k, or n > 1 (a branch is one sample)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"fork: k must be a positive int, got {k!r}")
    if suffixes is not None and len(suffixes) != k:
        raise ValueError(f"fork: {len(suffixes)} suffixes for k={k} branches")
    if sampling.get("n", 1) != 1:
        raise ValueError("fork: each branch is one sample (n=1); fork more branches")
    tails: Sequence[list[int] | str | None] = suffixes or [None] * k
    return [join_prompt(prefix, s) for s in tails]


def join_prompt(prefix: list[int] | str, suffix: list[int] | str | None) -> list[int] | str:
    """`prefix` + `suffix`, both token ids or both text."""
    if suffix is None:
        return prefix
    if isinstance(prefix, str) and isinstance(suffix, str):
        return prefix + suffix
    if not isinstance(prefix, str) and not isinstance(suffix, str):
        return [*prefix, *suffix]
    raise ValueError(
        "suffixes: give text suffixes for a text prefix and token-id suffixes for a token-id prefix"
    )


def branch_seeds(seed: int | None, k: int) -> list[int | None]:
    """One seed per branch (seed, seed + 1, ...), so seeded branches differ but repeat."""
    return [None] * k if seed is None else [seed + i for i in range(k)]


def aggregate(proposals: Sequence[T], k: int, score: Callable[[T], float] | None = None) -> list[T]:
    """The k best proposals by `score` (highest first; ties keep their order), or the first k
    when no score is given. Asking for more than there are is a ValueError, never a short
    (or empty) answer that a caller would mistake for a result."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"aggregate: k must be a positive int, got {k!r}")
    if k > len(proposals):
        raise ValueError(f"aggregate: asked for {k} proposals but only {len(proposals)} exist")
    order: Sequence[int] = range(len(proposals))
    if score is not None:
        scores = [score(p) for p in proposals]
        order = sorted(order, key=lambda i: -scores[i])
    return [proposals[i] for i in list(order)[:k]]
