"""`raylane bench throughput --batch-invariant`: what the batch-invariant mode costs. One engine
with the mode off and one with it on, side by side in each dtype (float32 and bfloat16 unless
--dtype says), serial scheduling, the timed passes alternating; tok/s of each and the ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raylane.bench.throughput_runs import Workload, engines_for, greedy_params, timed_passes

MODES = (False, True)  # batch_invariant off, on


@dataclass(frozen=True)
class ModeTimes:
    dtype: str
    seconds: dict[bool, float]  # batch_invariant -> the best timed pass


def mode_engines(model_dir: str, dtype: str, max_batched: int, max_num_seqs: int) -> Any:
    """The two engines, off and on, as a context manager giving {batch_invariant: engine}."""
    # serial: the step is the forward and the engine's own work, nothing overlapped
    options = {on: {"async_scheduling": False, "batch_invariant": on} for on in MODES}
    common = {"dtype": dtype, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched}
    return engines_for(model_dir, options, **common)


def time_modes(engines: dict[bool, Any], work: Workload, dtype: str, repeats: int) -> ModeTimes:
    passes = timed_passes(engines, work, greedy_params(work), repeats)
    return ModeTimes(dtype, {on: min(p[on] for p in passes) for on in MODES})


def print_modes(work: Workload, runs: list[Any], max_num_seqs: int, threads: int) -> None:
    """The tok/s table: each run's dtype and seconds (a ModeTimes or anything with both)."""
    print(
        f"\nbatch-invariant mode off vs on: {len(work.prompts)} requests, prompt tokens "
        f"{sum(map(len, work.prompts))}, useful output tokens {work.useful_tokens}, greedy, "
        f"ignore_eos, max_num_seqs={max_num_seqs}, serial scheduling, {threads} torch threads"
    )
    print(f"| {'dtype':<8} | {'mode':<4} | {'seconds':>8} | {'useful tok/s':>12} | {'on/off':>6} |")
    print(f"|{'-' * 10}|{'-' * 6}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    for run in runs:
        off = run.seconds[False]
        for on in MODES:
            seconds = run.seconds[on]
            ratio = f"{off / seconds:>5.2f}x" if on else ""
            print(
                f"| {run.dtype:<8} | {'on' if on else 'off':<4} | {seconds:>8.2f} | "
                f"{work.useful_tokens / seconds:>12.1f} | {ratio:>6} |"
            )
    print("(on/off: throughput with the mode on over off, the best of the timed passes)")


def run(
    model_dir: str, work: Workload, dtypes: list[str], max_batched: int, size: int, repeats: int
) -> int:
    """Both modes in each dtype at max_num_seqs=size, then the table."""
    import torch

    runs = []
    for dtype in dtypes:
        with mode_engines(model_dir, dtype, max_batched, size) as engines:
            runs.append(time_modes(engines, work, dtype, repeats))
    print_modes(work, runs, size, torch.get_num_threads())
    return 0
