"""`python -m benchmarks throughput --json-object`: open-ended constrained answers against free
text, on one engine in the same run: `json_object`, and a required tool call whose argument is a
free string, beside unconstrained answers of the same lengths.

Every request is the chat `Tell me a joke.` at temperature 0.8, seeded (request i: seed i + 1).
The constrained variant runs first; each free request then gets exactly its constrained
twin's length (ignore_eos), so both generate the same tokens per request. Reported per
variant: time per output token (a request's decode time over its tokens after the first,
averaged over requests) and the p99 gap between a request's consecutive tokens; the ratios
divide by the free row. Only rows of one run compare: the machine's load moves all of them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

PROMPT = [{"role": "user", "content": "Tell me a joke."}]
JOKE_PARAMETERS = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}
JOKE_TOOL = {
    "type": "function",
    "function": {
        "name": "tell_joke",
        "description": "Tell the user a joke.",
        "parameters": JOKE_PARAMETERS,
    },
}
# what tool_choice="required" constrains the output to (session_server/tool_calls/choice.py)
TOOL_CALL_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["tell_joke"]},
                    "arguments": JOKE_PARAMETERS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        ]
    },
}


@dataclass
class GapRow:
    name: str
    batch: int
    tokens: int
    seconds: float
    tpot_ms: float  # mean over requests of (decode time / tokens after the first)
    p99_gap_ms: float


def run_open_ended(model_dir: str, batch: int, max_tokens: int) -> list[GapRow]:
    """Rows for json_object, its free twin, the tool call and its free twin, at `batch`."""
    from raylane.actors.engine import (
        EngineConfig,
        LLMEngine,
        SamplingParams,
        StructuredOutputsParams,
    )

    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_num_seqs=batch))
    variants = {
        "json_object": (StructuredOutputsParams(json_object=True), {}),
        "tool call (free-text argument)": (
            StructuredOutputsParams(json=TOOL_CALL_SCHEMA),
            {"tools": [JOKE_TOOL]},
        ),
    }
    rows = []
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        for name, (spec, template) in variants.items():
            prompt = engine.validator.render_chat(PROMPT, add_generation_prompt=True, **template)
            # both variants then find the prompt in the prefix cache (no prefill in the timing)
            engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            params = [
                SamplingParams(
                    temperature=0.8, seed=i + 1, max_tokens=max_tokens, structured_outputs=spec
                )
                for i in range(batch)  # seed 1: the answer of issue 29
            ]
            row, lengths = _timed(engine, name, prompt, params)
            free = [
                dataclasses.replace(p, structured_outputs=None, max_tokens=n, ignore_eos=True)
                for p, n in zip(params, lengths)
            ]
            rows += [_timed(engine, f"free text (as {name})", prompt, free)[0], row]
    finally:
        engine.shutdown()
    return rows


def _timed(engine, name: str, prompt, params) -> tuple[GapRow, list[int]]:
    """Run the requests to the end, stepping by hand to stamp each token's arrival."""
    ids = [f"{name}-{i}" for i in range(len(params))]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    for rid, p in zip(ids, params):
        engine.admit(rid, prompt, p)
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            now = time.perf_counter()
            stamps[delta.request_id] += [now] * len(delta.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    gaps = sorted(b - a for s in stamps.values() for a, b in zip(s, s[1:]))
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    lengths = [len(stamps[rid]) for rid in ids]
    row = GapRow(
        name,
        len(params),
        sum(lengths),
        seconds,
        1e3 * sum(tpot) / max(1, len(tpot)),
        1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
    )
    return row, lengths


def print_gap_table(rows: list[GapRow], max_tokens: int) -> None:
    print(
        f"\nopen-ended answers (Tell me a joke., temperature 0.8, seeds 1..batch, up to "
        f"{max_tokens} tokens), float32; ratios against the free twin of the same lengths"
    )
    print(
        "| variant                                  | batch | tokens | seconds | TPOT ms "
        "| TPOT ratio | p99 gap ms | p99 ratio |"
    )
    print(
        f"|{'-' * 42}|-------|--------|---------|---------|------------|------------|-----------|"
    )
    base: GapRow | None = None
    for r in rows:
        if r.name.startswith("free text"):
            base = r
        assert base is not None
        tpot, p99 = r.tpot_ms / max(base.tpot_ms, 1e-9), r.p99_gap_ms / max(base.p99_gap_ms, 1e-9)
        print(
            f"| {r.name:<40} | {r.batch:>5} | {r.tokens:>6} | {r.seconds:>7.1f} | "
            f"{r.tpot_ms:>7.1f} | {tpot:>9.2f}x | {r.p99_gap_ms:>10.1f} | {p99:>8.2f}x |"
        )
