"""Graph of thought with the rollout client: generate proposals, score them, aggregate the best.

Against a running `raylane serve` (default http://127.0.0.1:8000):

    python -m raylane.examples.graph_of_thought --question "How many legs do 3 spiders have?"

1. generate: `fork` k branches on one chat prefix, each opened with a different approach, so
   they share the prefix's KV blocks on one replica and decode in the same engine steps;
2. prune and score: once `--keep` branches have finished, the stragglers are released (their
   KV blocks freed at once); each proposal is scored by its mean token logprob (the model's
   own confidence; any scorer works);
3. aggregate: the two best proposals go into one prompt that asks for a final answer.
Asking `aggregate` for more proposals than exist is a ValueError, never an empty success.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from raylane.client import Rollout, RolloutClient

APPROACHES = (
    "Let's reason step by step.",
    "Let's work backwards from what is asked.",
    "Let's first list the facts we know.",
    "Let's estimate, then check exactly.",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--admin-key",
        default=None,
        help="the server's admin key: released branches are also aborted by id",
    )
    parser.add_argument(
        "--question",
        default="A farmer has 17 sheep and buys 8 more, then sells 5. How many sheep does he have?",
    )
    parser.add_argument("--k", type=int, default=4, help=f"branches (at most {len(APPROACHES)})")
    parser.add_argument(
        "--keep", type=int, default=3, help="branches to wait for; the rest are released"
    )
    parser.add_argument("--best", type=int, default=2, help="proposals to aggregate")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def confidence(rollout: Rollout) -> float:
    """Mean logprob of the proposal's tokens (higher: the model was surer)."""
    logprobs = rollout.logprobs or []
    return sum(logprobs) / max(1, len(logprobs))


async def propose(
    client: RolloutClient, question: str, k: int, keep: int, max_tokens: int, seed: int
) -> list[Rollout]:
    prefix = await client.tokenize(
        messages=[
            {"role": "system", "content": "You solve problems carefully and state the answer."},
            {"role": "user", "content": question},
        ]
    )
    suffixes = [await _ids(client, " " + a) for a in APPROACHES[:k]]
    branches = await client.fork(
        prefix, k, suffixes=suffixes, temperature=0.7, seed=seed, max_tokens=max_tokens
    )
    finished: list = []
    pending = {b.task for b in branches}
    while len(finished) < min(keep, k):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finished += done
    stragglers = [b for b in branches if not b.done()]
    for b in stragglers:
        await client.release(b)
    if stragglers:
        print(f"released {len(stragglers)} straggler(s) after {len(finished)} finished")
    return [(await b.result()) for b in branches if b.task in finished]


async def _ids(client: RolloutClient, text: str) -> list[int]:
    ids = await client.tokenize(text)
    probe = await client.tokenize("")  # what the tokenizer adds to any text (e.g. a BOS)
    return ids[len(probe) :] if ids[: len(probe)] == probe else ids


async def aggregate_answer(
    client: RolloutClient, question: str, best: list[Rollout], max_tokens: int
) -> Rollout:
    drafts = "\n\n".join(f"Draft {i + 1}:\n{r.text.strip()}" for i, r in enumerate(best))
    prompt = await client.tokenize(
        messages=[
            {
                "role": "user",
                "content": (
                    f"{question}\n\nHere are draft solutions:\n\n{drafts}\n\n"
                    "Combine the drafts into one short, correct final answer."
                ),
            }
        ]
    )
    (final,) = await client.generate(prompt, temperature=0.0, max_tokens=max_tokens)
    return final


async def main(args: argparse.Namespace) -> None:
    if not 1 <= args.k <= len(APPROACHES):
        raise SystemExit(f"--k must be in [1, {len(APPROACHES)}]")
    async with RolloutClient(args.url, api_key=args.api_key, admin_key=args.admin_key) as client:
        start = time.perf_counter()
        proposals = await propose(
            client, args.question, args.k, args.keep, args.max_tokens, args.seed
        )
        print(
            f"{len(proposals)} proposals in {time.perf_counter() - start:.1f} s "
            f"(weights version {proposals[0].weight_version}):"
        )
        for i, r in enumerate(proposals):
            print(f"  [{i}] confidence {confidence(r):+.3f}  {r.text.strip()[:100]!r}")
        try:
            best = client.aggregate(proposals, args.best, score=confidence)
        except ValueError as e:  # --best > the proposals kept
            raise SystemExit(f"cannot aggregate: {e}") from None
        final = await aggregate_answer(client, args.question, best, args.max_tokens)
        print(f"\naggregated the {len(best)} most confident into:\n{final.text.strip()}")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
