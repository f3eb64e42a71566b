"""Helpers for the speculative-decoding tests: a tiny Llama whose greedy output loops (so
n-gram drafts get accepted), and an executor tap that counts drafts and accepted tokens from
the step plans and results themselves (independently of the engine's counters)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from raylane.actors.engine import EngineConfig, LLMEngine
from raylane.actors.runner.plan import StepPlan

from tests.hf_reference import hf_model
from tests.tiny_models import make_llama


def make_loopy_llama(path: str | Path, attention_scale: float = 0.05) -> str:
    """The tiny Llama with its MLP output zeroed and attention output scaled down: the next
    token depends mostly on the current one, so greedy decoding falls into short cycles, while
    attention still moves every logprob (a wrong KV row would show)."""
    make_llama(path)
    return make_loopy(path, attention_scale)


def make_loopy(path: str | Path, attention_scale: float = 0.05) -> str:
    """Make the saved model at `path` loopy (see make_loopy_llama): every token mixer's output
    projection (attention's o_proj, a linear-attention layer's out_proj) scaled down, every
    MLP's down_proj zeroed. A wrong recurrent state still moves every logprob."""
    from safetensors.torch import load_file, save_file

    weights_file = Path(path) / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight")):
            weights[name] = weights[name] * attention_scale
        elif name.endswith("down_proj.weight"):
            weights[name] = weights[name] * 0
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(path)


def make_echo(path: str | Path, attention_scale: float = 0.2) -> str:
    """Make the saved model at `path` echo: its LM head set to its embedding, every MLP's
    (and expert's) down projection zeroed and attention's output scaled down, so greedy decoding
    repeats tokens for a while and then moves on (n-gram drafts both accepted and rejected,
    for models whose plain random weights never repeat), while attention still moves every
    logprob."""
    from safetensors.torch import load_file, save_file

    weights_file = Path(path) / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = weights[name] * attention_scale
        elif "down_proj" in name:
            weights[name] = weights[name] * 0
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(path)


def sharpened_copy(model_dir: str, out: str | Path, factor: float = 2.5) -> str:
    """A copy of the model with its final norm scaled by `factor`: logits x factor, the same
    order, so as a draft its q is the model's distribution made sharper (its drafts are
    often kept and often rejected)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights_file = Path(out) / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.norm.weight"] = weights["model.norm.weight"] * factor
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(out)


def spec_engine(model_dir: str, spec: dict | None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("async_scheduling", False)
    return LLMEngine(EngineConfig(model=model_dir, speculative_config=spec, **kw))


def on_results(engine: LLMEngine, see: Callable[[StepPlan, Any], None]) -> None:
    """Wrap the engine's executor so that `see(plan, result)` runs on each step's result before
    the engine gets it. (A callback added to the executor's own future may run after the engine
    already took the result and went on: under load, a test read its counts before the last
    step's were in.) What `see` raises fails the step."""
    submit = engine.executor.submit

    def tapped(plan: StepPlan) -> Future:
        seen: Future = Future()

        def done(step: Future) -> None:
            try:
                result = step.result()
                see(plan, result)
            except BaseException as e:
                seen.set_exception(e)
            else:
                seen.set_result(result)

        submit(plan).add_done_callback(done)
        return seen

    engine.executor.submit = tapped  # type: ignore[method-assign]


class Tap:
    """Wraps an engine's executor: counts drafts from each plan and accepted tokens from each
    result's extra tokens (per draft position too)."""

    def __init__(self, engine: LLMEngine, k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.per_pos = [0] * k
        on_results(engine, self._count)

    def _count(self, plan: StepPlan, result) -> None:
        drafts = dict(plan.draft_token_ids)
        order = [seq_id for seq_id, _ in plan.scheduled]
        self.num_drafts += len(drafts)
        self.num_draft_tokens += sum(len(d) for d in drafts.values())
        for seq_id, extra in zip(order, result.extra):
            if extra is not None:
                assert seq_id in drafts
                self.num_accepted += len(extra.token_ids)
                for pos in range(len(extra.token_ids)):
                    self.per_pos[pos] += 1


@torch.inference_mode()
def hf_probability(
    model_dir: str, prompt: list[int], paths: list[tuple[int, ...]], temperature: float, top_k: int
) -> dict:
    """P(path | prompt) under top-k softmax(logits / T) at each position, from Hugging Face's
    full forward of every prefix (the naive reference)."""
    model = hf_model(model_dir)
    probs = {}
    for path in paths:
        ids = torch.tensor([prompt + list(path)])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(path) - 1].float()
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        p = torch.softmax(logits.masked_fill(logits < kth, float("-inf")) / temperature, dim=-1)
        probs[path] = float(p[torch.arange(len(path)), torch.tensor(path)].prod())
    return probs


def chi_square_p_value(observed: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's test over the outcomes expected >= 5 times, the rest pooled in one bin:
    (p-value, degrees of freedom)."""
    bins = [t for t in probs if probs[t] * n >= 5]
    obs = [observed[t] for t in bins] + [n - sum(observed[t] for t in bins)]
    exp = [probs[t] * n for t in bins] + [n * (1 - sum(probs[t] for t in bins))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(obs) - 1
    p = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)).item()
    return p, dof
