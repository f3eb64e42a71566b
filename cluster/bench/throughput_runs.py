"""The timed runs of `raylane bench throughput` (and `python -m benchmarks step`'s workload): a
seeded random workload, the offline engine per async_scheduling mode, and transformers'
static-batch generate."""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)  # what tells a run's engines apart


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # skip the low ids, where small vocabularies keep their special tokens
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])


def run_engines(
    model_dir: str,
    work: Workload,
    max_batched: int,
    max_num_seqs: int,
    modes: tuple[bool, ...],
    repeats: int = 1,
    warm: bool = True,
    dtype: str = "float32",
    capture: bool = False,
) -> list[dict[bool, float]]:
    """Seconds per timed pass, one engine per async_scheduling mode (see `timed_passes`)."""
    from transformers import AutoConfig

    picks = capture and bool(getattr(AutoConfig.from_pretrained(model_dir), "index_topk", 0))
    captures = {"enable_return_routed_experts": capture, "enable_return_indexer_topk": picks}
    options = {on: {"async_scheduling": on, **captures} for on in modes}
    params = greedy_params(work, return_routed_experts=capture, return_indexer_topk=picks)
    common = {"dtype": dtype, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched}
    with engines_for(model_dir, options, **common) as engines:
        return timed_passes(engines, work, params, repeats, warm)


def greedy_params(work: Workload, **options) -> list:
    """Greedy, exactly each request's output length (ignore_eos)."""
    from raylane.actors.engine import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **options)
        for n in work.output_lens
    ]


@contextmanager
def engines_for(model_dir: str, options: dict[K, dict], **common: Any) -> Iterator[dict[K, Any]]:
    """One LLMEngine per entry of `options` (EngineConfig fields on top of `common`), all shut
    down at the end."""
    from raylane.actors.engine import EngineConfig, LLMEngine

    engines = {
        key: LLMEngine(EngineConfig(model=model_dir, **common, **extra))
        for key, extra in options.items()
    }
    try:
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def timed_passes(
    engines: dict[K, Any], work: Workload, params: list, repeats: int, warm: bool = True
) -> list[dict[K, float]]:
    """Seconds per timed pass per engine, the engines alternating pass by pass so drift on a
    shared machine hits them alike. `warm`: a whole untimed pass first (the first pass pays
    one-time costs per new batch shape, up to 40% of it)."""
    for engine in engines.values():
        warm_up = work.prompts if warm else [[1, 2, 3]]
        engine.generate(warm_up, params[: len(warm_up)], use_tqdm=False)
    return [
        {key: timed_pass(engine, work, params) for key, engine in engines.items()}
        for _ in range(repeats)
    ]


def timed_pass(engine, work: Workload, params, use_tqdm: bool = True) -> float:
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == work.useful_tokens, (got, work.useful_tokens)
    return elapsed


def run_hf(model_dir: str, work: Workload, dtype: str = "float32") -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    longest = max(len(p) for p in work.prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in work.prompts])
    kwargs = {
        "attention_mask": mask,
        "do_sample": False,
        "max_new_tokens": max(work.output_lens),
        "min_new_tokens": max(work.output_lens),
        "pad_token_id": pad,
    }
    with torch.inference_mode():
        model.generate(
            ids[:1, :4], attention_mask=mask[:1, :4], max_new_tokens=2, pad_token_id=pad
        )  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kwargs)
    return time.perf_counter() - start
