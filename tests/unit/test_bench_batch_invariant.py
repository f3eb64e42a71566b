"""`python -m benchmarks throughput --batch-invariant` on a tiny model: the mode off and on in the
same run, the tok/s table with its ratio, and the op table whose times add up to the pass."""

from __future__ import annotations

import argparse

import pytest
from raylane.bench.throughput_runs import make_workload

from benchmarks.batch_invariant import run_modes
from benchmarks.op_times import (
    ATTENTION,
    FUSED,
    KINDS,
    LINEAR,
    OUTSIDE,
    REST,
    TOTAL,
    OpCost,
)
from benchmarks.throughput import add_arguments, run


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_off_and_on_each_time_their_ops(tiny_llama_dir):
    work = make_workload(3, (4, 20), (2, 5), 256, seed=1)
    result = run_modes(tiny_llama_dir, work, "float32", 256, 4, repeats=1)
    assert set(result.seconds) == set(result.ops) == {False, True}
    off, on = result.ops[False], result.ops[True]
    assert on.impls[LINEAR] == "oneDNN packed, rows padded to 16"  # the packs, padded
    assert off.impls[LINEAR] != on.impls[LINEAR]  # oneDNN packed, or plain F.linear
    assert on.impls[ATTENTION] == "cpu" and on.impls[FUSED]  # the C kernel; a registry name
    for cost in (off, on):
        assert all(cost.ms[k] > 0 for k in (LINEAR, FUSED, ATTENTION, OUTSIDE, TOTAL))
        assert cost.ms[REST] >= 0
        parts = sum(cost.ms[k] for k in KINDS if k != TOTAL)
        assert parts == pytest.approx(cost.ms[TOTAL])


def test_the_option_runs_both_dtypes_by_default_and_prints_the_tables(
    tiny_llama_dir, capsys, monkeypatch
):
    import benchmarks.batch_invariant as bench

    ran = []

    def fake_run_modes(model_dir, work, dtype, max_batched, max_num_seqs, repeats):
        ran.append((dtype, max_num_seqs))
        ms = dict.fromkeys(KINDS, 10.0) | {LINEAR: 30.0, TOTAL: 70.0}
        impls = {LINEAR: "a", FUSED: "b", ATTENTION: "c"}
        off, on = OpCost(ms, impls), OpCost(ms | {LINEAR: 60.0, TOTAL: 100.0}, impls)
        return bench.ModeRun(dtype, {False: 1.0, True: 4.0}, {False: off, True: on})

    monkeypatch.setattr(bench, "run_modes", fake_run_modes)
    argv = ["--batch-invariant", "--model", tiny_llama_dir, "--num-requests", "2"]
    assert run(args(*argv, "--batch-sizes", "2,8")) == 0
    assert ran == [("float32", 2), ("bfloat16", 2)]
    out = capsys.readouterr().out
    assert "max_num_seqs=2, serial scheduling" in out
    for dtype in ("float32", "bfloat16"):
        assert f"| {dtype:<8} | on   |" in out and f"where the cost is, {dtype}" in out
    assert " 0.25x |" in out  # on/off throughput
    assert "|     30.0 |     60.0 |              100% |" in out  # all of the 30 ms of cost
    assert run(args(*argv, "--dtype", "bfloat16")) == 0
    assert ran[2:] == [("bfloat16", 32)]
