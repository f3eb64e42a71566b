"""`python -m benchmarks throughput --batch-invariant`: `raylane bench throughput
--batch-invariant` (raylane.bench.batch_invariant: the mode off and on side by side, tok/s),
then as many passes each with the forward's ops timed, so the table says which op the cost is
in."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from raylane.bench.batch_invariant import MODES, ModeTimes, mode_engines, time_modes
from raylane.bench.batch_invariant import print_modes as print_mode_table
from raylane.bench.throughput_runs import Workload, greedy_params, timed_pass

from benchmarks.op_times import KINDS, TOTAL, OpCost, timed_op_pass


@dataclass(frozen=True)
class ModeRun(ModeTimes):
    ops: dict[bool, OpCost]  # batch_invariant -> the fastest op-timed pass


def run_modes(
    model_dir: str, work: Workload, dtype: str, max_batched: int, max_num_seqs: int, repeats: int
) -> ModeRun:
    params = greedy_params(work)
    with mode_engines(model_dir, dtype, max_batched, max_num_seqs) as engines:
        times = time_modes(engines, work, dtype, repeats)
        ops = [
            {
                on: timed_op_pass(e, functools.partial(timed_pass, e, work, params, False))
                for on, e in engines.items()
            }
            for _ in range(repeats)
        ]
    # each mode's op pass with the smallest total: the one a busy machine disturbed least
    fastest = {on: min((p[on] for p in ops), key=lambda c: c.ms[TOTAL]) for on in MODES}
    return ModeRun(dtype, times.seconds, fastest)


def print_modes(work: Workload, runs: list[ModeRun], max_num_seqs: int, threads: int) -> None:
    print_mode_table(work, runs, max_num_seqs, threads)
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
