"""The table of `raylane bench throughput`: seconds and useful tok/s per system and dtype, each
against its reference."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.bench.throughput_runs import Workload


@dataclass(frozen=True)
class Row:
    name: str
    dtype: str
    seconds: float
    engine: bool = True  # False: the transformers reference


def print_table(work: Workload, rows: list[Row], threads: int) -> None:
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    print(
        f"\nworkload: {len(work.prompts)} requests, prompt tokens "
        f"{sum(map(len, work.prompts))}, useful output tokens {work.useful_tokens}, greedy, "
        f"ignore_eos, {', '.join(dtypes)}, {threads} torch threads"
    )
    print(
        f"| {'system':<42} | {'dtype':<8} | {'seconds':>8} | {'useful tok/s':>12} | {'ratio':>6} |"
    )
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    refs = reference_seconds(rows)
    for r in rows:
        print(
            f"| {r.name:<42} | {r.dtype:<8} | {r.seconds:>8.2f} | "
            f"{work.useful_tokens / r.seconds:>12.1f} | {refs[r.dtype] / r.seconds:>5.2f}x |"
        )
    if any(not r.engine for r in rows):
        print("(ratio: against transformers generate in the same dtype)")
    else:
        print(f"(ratio: against the last {dtypes[0]} row)")
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b.dtype == r.dtype and b.name == r.name.replace(", async scheduling", ", serial")
            ),
            None,
        )
        if r.name.endswith(", async scheduling") and base:
            print(
                f"{r.name.removesuffix(', async scheduling')}, {r.dtype}: async / serial "
                f"throughput {base.seconds / r.seconds:.3f}x"
            )
    best = min((r for r in rows if r.engine), key=lambda r: r.seconds)
    print(
        f"raylane's best dtype: {best.dtype}, {work.useful_tokens / best.seconds:.1f} useful "
        f"tok/s ({best.name})"
    )


def reference_seconds(rows: list[Row]) -> dict[str, float]:
    """dtype -> the seconds each row's ratio divides: transformers in that dtype, or without
    the reference the last row of the first dtype (one scale for every dtype)."""
    hf = {r.dtype: r.seconds for r in rows if not r.engine}
    if hf:
        return hf
    first = [r for r in rows if r.dtype == rows[0].dtype]
    return dict.fromkeys({r.dtype for r in rows}, first[-1].seconds)
