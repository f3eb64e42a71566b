"""`python -m benchmarks throughput --batch-invariant`: the batch-invariant mode's cost. One
engine with the mode off and one with it on, side by side in each dtype, the timed passes
alternating; then as many passes each with the forward's ops timed, so the table says which op
the cost is in."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from raylane.bench.throughput_runs import (
    Workload,
    engines_for,
    greedy_params,
    timed_pass,
    timed_passes,
)

from benchmarks.op_times import KINDS, TOTAL, OpCost, timed_op_pass


@dataclass(frozen=True)
class ModeRun:
    dtype: str
    seconds: dict[bool, float]  # batch_invariant -> the best timed pass
    ops: dict[bool, OpCost]  # batch_invariant -> the fastest op-timed pass


def run_modes(
    model_dir: str, work: Workload, dtype: str, max_batched: int, max_num_seqs: int, repeats: int
) -> ModeRun:
    # serial: the step is the forward and the engine's own work, nothing overlapped
    options = {on: {"async_scheduling": False, "batch_invariant": on} for on in (False, True)}
    params = greedy_params(work)
    common = {"dtype": dtype, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched}
    with engines_for(model_dir, options, **common) as engines:
        passes = timed_passes(engines, work, params, repeats)
        ops = [
            {
                on: timed_op_pass(e, functools.partial(timed_pass, e, work, params, False))
                for on, e in engines.items()
            }
            for _ in range(repeats)
        ]
    # each mode's op pass with the smallest total: the one a busy machine disturbed least
    fastest = {on: min((p[on] for p in ops), key=lambda c: c.ms[TOTAL]) for on in (False, True)}
    return ModeRun(dtype, {on: min(p[on] for p in passes) for on in (False, True)}, fastest)


def print_modes(work: Workload, runs: list[ModeRun], max_num_seqs: int, threads: int) -> None:
    print(
        f"\nbatch-invariant mode off vs on: {len(work.prompts)} requests, prompt tokens "
        f"{sum(map(len, work.prompts))}, useful output tokens {work.useful_tokens}, greedy, "
        f"ignore_eos, max_num_seqs={max_num_seqs}, serial scheduling, {threads} torch threads"
    )
    print(f"| {'dtype':<8} | {'mode':<4} | {'seconds':>8} | {'useful tok/s':>12} | {'on/off':>6} |")
    print(f"|{'-' * 10}|{'-' * 6}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    for run in runs:
        off = run.seconds[False]
        for on in (False, True):
            seconds = run.seconds[on]
            ratio = f"{off / seconds:>5.2f}x" if on else ""
            print(
                f"| {run.dtype:<8} | {'on' if on else 'off':<4} | {seconds:>8.2f} | "
                f"{work.useful_tokens / seconds:>12.1f} | {ratio:>6} |"
            )
    print("(on/off: throughput with the mode on over off, the best of the timed passes)")
    for run in runs:
        print_ops(run)


def print_ops(run: ModeRun) -> None:
    off, on = run.ops[False], run.ops[True]
    cost = on.ms[TOTAL] - off.ms[TOTAL]
    print(f"\nwhere the cost is, {run.dtype} (ms over one pass, forward hooks on each op)")
    print(
        f"| {'op':<23} | {'off -> on':<50} | {'off ms':>8} | {'on ms':>8} | "
        f"{'share of the cost':>17} |"
    )
    print(f"|{'-' * 25}|{'-' * 52}|{'-' * 10}|{'-' * 10}|{'-' * 19}|")
    for kind in KINDS:
        impl = f"{off.impls[kind]} -> {on.impls[kind]}" if kind in off.impls else ""
        share = _share(on.ms[kind] - off.ms[kind], cost) if kind != TOTAL else ""
        print(
            f"| {kind:<23} | {impl:<50} | {off.ms[kind]:>8.1f} | {on.ms[kind]:>8.1f} | "
            f"{share:>17} |"
        )
    print(
        "(share: the op's ms on minus off, over the pass's; negative: faster with the mode on. "
        "Fused ops and attention by their registries' names; cpu: the C kernels)"
    )


def _share(delta: float, cost: float) -> str:
    if cost <= 0:  # the mode cost nothing in this pass: no share to split
        return "-"
    return f"{100 * delta / cost:.0f}%"
