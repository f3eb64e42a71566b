"""Bitwise on-policy GRPO: a few steps on the embedded SmolLM2 in bfloat16, the trainer in this
script, the rollouts from a raylane server in its batch-invariant mode.

    raylane serve --batch-invariant --dtype bfloat16        # in one shell
    python -m raylane.examples.on_policy_grpo               # in another (a few minutes on a CPU)

Each step: sample a group of completions per prompt (seeded, temperature 1, raw logprobs),
score them with a toy reward, score the same tokens with the trainer's own transformers model
teacher-forced inside `raylane.batch_invariant()`, take one GRPO step, and push the new weights
back with `RolloutClient.update_weights`. It prints

    on-policy gap (mode on):  max |exp(train_logprob - rollout_logprob) - 1|  -> exactly 0
    without the context:      the same figure from transformers' own kernels -> ~1e-1 in bf16

so the importance ratio the loss sees is exactly 1 for every token, across weight versions.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import torch
from raylane.client import Rollout, RolloutClient
from raylane.on_policy import batch_invariant

PROMPTS = ("The capital of France is", "Once upon a time, a robot", "My favourite number is")


@dataclass
class StepReport:
    step: int
    version: int
    gap_on: float  # max |exp(train - rollout) - 1| inside batch_invariant()
    gap_off: float  # the same figure from transformers' own kernels
    mean_reward: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--admin-key", default=None, help="the server's admin key (weights)")
    parser.add_argument("--model", default=None, help="the served HF dir (default: SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def reward(rollout: Rollout) -> float:
    """A toy reward: the share of distinct tokens (it prefers completions that do not loop)."""
    return len(set(rollout.token_ids)) / max(1, len(rollout.token_ids))


def padded(rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt + completion of each rollout, right padded: (input_ids, attention_mask) [B, T]."""
    seqs = [r.prompt_token_ids + r.token_ids for r in rollouts]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def completion_logprobs(model, rollouts: list[Rollout], ids, mask) -> list[torch.Tensor]:
    """The trainer's logprob of each completion token, [len(completion)] per rollout."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    starts = [len(r.prompt_token_ids) - 1 for r in rollouts]
    return [lp[i, s : s + len(r.token_ids)] for i, (s, r) in enumerate(zip(starts, rollouts))]


def gap(train: list[torch.Tensor], rollouts: list[Rollout]) -> float:
    """max |exp(train_logprob - rollout_logprob) - 1| over every completion token."""
    worst = 0.0
    for t, r in zip(train, rollouts):
        ratio = torch.exp(t.detach() - torch.tensor(r.logprobs, dtype=torch.float32))
        worst = max(worst, float((ratio - 1).abs().max()))
    return worst


def advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO's: each reward against its group's mean, over the group's std."""
    out = []
    for start in range(0, len(rewards), group):
        g = torch.tensor(rewards[start : start + group])
        out += ((g - g.mean()) / (g.std(unbiased=False) + 1e-6)).tolist()
    return out


async def sample(client: RolloutClient, args, step: int) -> list[Rollout]:
    groups = await asyncio.gather(
        *(
            client.generate(
                p,
                n=args.group,
                temperature=1.0,
                seed=args.seed + 1000 * step + i,
                max_tokens=args.max_tokens,
                ignore_eos=True,
            )
            for i, p in enumerate(PROMPTS)
        )
    )
    return [r for g in groups for r in g]


async def grpo_step(client: RolloutClient, model, optimizer, args, step: int) -> StepReport:
    rollouts = await sample(client, args, step)
    ids, mask = padded(rollouts)
    with torch.no_grad():  # the contrast: transformers' own kernels
        gap_off = gap(completion_logprobs(model, rollouts, ids, mask), rollouts)
    with batch_invariant():
        train = completion_logprobs(model, rollouts, ids, mask)
    gap_on = gap(train, rollouts)
    rewards = [reward(r) for r in rollouts]
    adv = advantages(rewards, args.group)
    loss = torch.stack(
        [
            -(torch.exp(t - torch.tensor(r.logprobs)) * a).mean()
            for t, r, a in zip(train, rollouts, adv)
        ]
    ).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    version = await client.weight_version() + 1
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    version = await client.update_weights(named, version)
    return StepReport(step, version, gap_on, gap_off, sum(rewards) / len(rewards))


def load_trainer_model(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.train()  # no dropout in these models: train mode changes nothing numeric


async def run(args) -> list[StepReport]:
    from raylane.models import default_model_path

    model = load_trainer_model(args.model or default_model_path(), args.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    reports = []
    async with RolloutClient(args.url, api_key=args.api_key, admin_key=args.admin_key) as client:
        for step in range(args.steps):
            reports.append(await grpo_step(client, model, optimizer, args, step))
            r = reports[-1]
            print(
                f"step {r.step}: on-policy gap (mode on) {r.gap_on:.3g}, without the context "
                f"{r.gap_off:.3g}, mean reward {r.mean_reward:.3f}, weights now v{r.version}",
                flush=True,
            )
    return reports


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
