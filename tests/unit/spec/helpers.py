"""Helpers for the speculative-decoding tests: a tiny Llama whose greedy output loops (so
n-gram drafts get accepted), and an executor tap that counts drafts and accepted tokens from
the step plans and results themselves (independently of the engine's counters)."""

from __future__ import annotations

from pathlib import Path

from raylane.actors.engine import EngineConfig, LLMEngine
from raylane.actors.runner.plan import StepPlan

from tests.tiny_models import make_llama


def make_loopy_llama(path: str | Path, attention_scale: float = 0.05) -> str:
    """The tiny Llama with its MLP output zeroed and attention output scaled down: the next
    token depends mostly on the current one, so greedy decoding falls into short cycles, while
    attention still moves every logprob (a wrong KV row would show)."""
    from safetensors.torch import load_file, save_file

    make_llama(path)
    weights_file = Path(path) / "model.safetensors"
    weights = load_file(weights_file)
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = weights[name] * attention_scale
        elif name.endswith("down_proj.weight"):
            weights[name] = weights[name] * 0
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(path)


def spec_engine(model_dir: str, spec: dict | None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("async_scheduling", False)
    return LLMEngine(EngineConfig(model=model_dir, speculative_config=spec, **kw))


class Tap:
    """Wraps an engine's executor: counts drafts from each plan and accepted tokens from each
    result's extra tokens (per draft position too)."""

    def __init__(self, engine: LLMEngine, k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.per_pos = [0] * k
        submit = engine.executor.submit

        def tapped(plan: StepPlan):
            future = submit(plan)
            drafts = dict(plan.draft_token_ids)
            order = [seq_id for seq_id, _ in plan.scheduled]
            future.add_done_callback(lambda f: self._count(drafts, order, f.result()))
            return future

        engine.executor.submit = tapped  # type: ignore[method-assign]

    def _count(self, drafts: dict, order: list[int], result) -> None:
        self.num_drafts += len(drafts)
        self.num_draft_tokens += sum(len(d) for d in drafts.values())
        for seq_id, extra in zip(order, result.extra):
            if extra is not None:
                assert seq_id in drafts
                self.num_accepted += len(extra.token_ids)
                for pos in range(len(extra.token_ids)):
                    self.per_pos[pos] += 1
