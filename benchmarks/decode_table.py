"""`python -m benchmarks decode`'s cells and table: decode tok/s per system and batch size, the
graphs engine's ratios to eager and transformers, and its graph replays."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """One system at one batch size."""

    seconds: float  # the decode part of the best pass
    tokens: int  # decode tokens of one pass: batch * (output_len - 1)
    replays: int | None = None  # graph replays in one full pass (None: transformers)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def progress(system: str, batch: int, cell: Cell) -> Cell:
    """Each cell as it is measured (stderr), so a run cut short still says what it found."""
    print(f"  {system:>12} batch {batch:>4}: {cell.tok_s:10.1f} decode tok/s", file=sys.stderr)
    return cell


def print_table(
    columns: dict[str, dict[int, Cell]],
    sizes: list[int],
    args: argparse.Namespace,
    label: str,
    dtype: str,
    device,
    max_model_len: int,
) -> None:
    print(
        f"\ndecode tok/s: {label}, {dtype} on {device}, {args.prompt_len}-token prompts, "
        f"{args.output_len} output tokens (decode: the last {args.output_len - 1}), greedy, "
        f"ignore_eos, max_model_len {max_model_len}, best of {args.repeats}"
    )
    if device.type != "cuda":
        print(
            "NOTE: not CUDA, so 'graphs' is the graph runner's eager replay over its padded "
            "static buffers (enforce_eager=False); nothing is captured"
        )
    names = list(columns)
    ratios = [("graphs / eager", "eager")] + [("graphs / HF", "transformers")] * (
        "transformers" in columns
    )
    heads = [f"{n} tok/s" for n in names] + [r for r, _ in ratios] + ["graph replays"]
    print("| batch | " + " | ".join(f"{h:>18}" for h in heads) + " |")
    print("|-------|" + "|".join("-" * 20 for _ in heads) + "|")
    for b in sizes:
        graphs = columns["graphs"][b]
        cells = [f"{columns[n][b].tok_s:>18.1f}" for n in names]
        cells += [f"{graphs.tok_s / columns[ref][b].tok_s:>17.2f}x" for _, ref in ratios]
        cells.append(f"{graphs.replays:>18}")
        print(f"| {b:>5} | " + " | ".join(cells) + " |")
    eager_replays = sum(c.replays or 0 for c in columns["eager"].values())
    print(
        f"(graph replays: in one timed pass of the graphs engine, one per decode step, so "
        f"{args.output_len - 1} when every step replayed; the eager engine replayed "
        f"{eager_replays})"
    )
