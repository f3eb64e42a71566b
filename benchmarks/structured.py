"""`python -m benchmarks throughput --json-schema FILE`: the same workload with every request
constrained to a JSON schema and without, on one engine, in alternating passes.

Constrained outputs end when the schema completes, so after a warm constrained pass each
unconstrained request gets exactly the length its constrained twin had: both variants then
generate the same tokens per request and the same batch shapes step by step, and the ratio is
the constraint's own cost. Where the time goes: "plan" (per step) holds computing the grammar
masks on the engine, "sample" applying them on the runner.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass


@dataclass
class SchemaRow:
    name: str
    seconds: float
    tokens: int
    steps: int
    plan_ms: float
    sample_ms: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run_schema(
    model_dir: str, work, schema_path: str, max_batched: int, max_num_seqs: int, repeats: int
) -> list[SchemaRow]:
    from raylane.actors.engine import (
        EngineConfig,
        LLMEngine,
        SamplingParams,
        StructuredOutputsParams,
    )
    from raylane.actors.engine.stats import StepTimes

    with open(schema_path) as f:
        schema = json.load(f)
    spec = StructuredOutputsParams(json=schema)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=spec)
        for n in work.output_lens
    ]
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
        )
    )
    best: dict[str, SchemaRow] = {}
    try:
        # warm (per-shape costs, the grammar's compile), and each request's constrained length
        outs = engine.generate(work.prompts, constrained, use_tqdm=False)
        free = [
            dataclasses.replace(p, structured_outputs=None, max_tokens=len(o.outputs[0].token_ids))
            for p, o in zip(constrained, outs)
        ]
        engine.generate(work.prompts, free, use_tqdm=False)
        variants = {"unconstrained": free, "JSON schema": constrained}
        for _ in range(repeats):
            for name, params in variants.items():
                engine.stats.step_times = StepTimes()
                start = time.perf_counter()
                outs = engine.generate(work.prompts, params, use_tqdm=True)
                row = _row(name, time.perf_counter() - start, outs, engine.stats.step_times)
                if name not in best or row.tok_s > best[name].tok_s:
                    best[name] = row
    finally:
        engine.shutdown()
    return [best["unconstrained"], best["JSON schema"]]


def _row(name: str, seconds: float, outs, times) -> SchemaRow:
    ms = times.per_step_ms()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return SchemaRow(name, seconds, tokens, times.steps, ms["plan"], ms["sample"])


def print_schema_table(rows: list[SchemaRow], schema_path: str, max_num_seqs: int) -> None:
    print(f"\nJSON schema {schema_path}, max_num_seqs={max_num_seqs}, greedy, float32")
    print("| variant       | seconds | tokens | tok/s  | vs free | steps | plan ms | sample ms |")
    print("|---------------|---------|--------|--------|---------|-------|---------|-----------|")
    base = rows[0].tok_s
    for r in rows:
        print(
            f"| {r.name:<13} | {r.seconds:>7.2f} | {r.tokens:>6} | {r.tok_s:>6.1f} | "
            f"{r.tok_s / base:>6.1%} | {r.steps:>5} | {r.plan_ms:>7.3f} | {r.sample_ms:>9.3f} |"
        )
    print("(plan: per step, includes computing the grammar masks; sample: includes applying them)")
