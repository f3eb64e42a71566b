"""`raylane bench throughput --batch-invariant` and its developers' form `python -m benchmarks
throughput --batch-invariant` on a tiny model: the mode off and on in the same run, the tok/s
table with its ratio, and (the developers' form) the op table whose times add up to the pass."""

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


def test_raylane_bench_throughput_batch_invariant_prints_both_dtypes_off_and_on(
    tiny_llama_dir, capsys
):
    from raylane.cli import main

    argv = ["bench", "throughput", "--batch-invariant", "--model", tiny_llama_dir]
    argv += ["--num-requests", "2", "--prompt-len", "4", "8", "--output-len", "3", "3"]
    assert main([*argv, "--batch-sizes", "2,8"]) == 0
    out = capsys.readouterr().out
    # 2 requests of exactly 3 output tokens each, at the first batch size
    assert "useful output tokens 6," in out and "max_num_seqs=2, serial scheduling" in out
    assert "where the cost is" not in out  # the op table is the developers' form only
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row] for row in rows]
    assert [(c[0], c[1]) for c in cells] == [
        ("float32", "off"),
        ("float32", "on"),
        ("bfloat16", "off"),
        ("bfloat16", "on"),
    ]
    for off, on in (cells[0:2], cells[2:4]):
        # the ratio is on's throughput over off's
        assert off[4] == "" and float(on[4].rstrip("x")) == pytest.approx(
            float(on[3]) / float(off[3]), rel=0.05, abs=0.01
        )
