"""`raylane bench serve`'s pure helpers: per-round workloads and the paired-round ratio."""

from __future__ import annotations

import argparse

from raylane.bench.serve import add_arguments, round_work
from raylane.bench.serve_load import RunResult
from raylane.bench.serve_table import Rows, print_table


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_round_and_its_warm_up_get_their_own_prompts():
    a = args("--requests", "8")
    prompts = [p for k in range(3) for work in round_work(a, k) for p, _ in work]
    assert len(prompts) == 6 * 8
    assert len(set(prompts)) == len(prompts)  # no round hits a prefix an earlier one cached
    assert round_work(a, 1) == round_work(args("--requests", "8"), 1)  # seeded: repeatable


def run(tok_s: float, requests: int = 10) -> RunResult:
    return RunResult(wall_s=10.0, output_tokens=int(tok_s * 10), requests=requests)


def test_the_ratio_is_the_median_of_paired_rounds(capsys):
    # round 2 ran while the machine was slow, for both systems
    http = Rows("raylane HTTP", [run(170), run(100), run(190)])
    offline = Rows("raylane offline LLMEngine", [run(200), run(150), run(180)])
    print_table([http, offline], 64)
    out = capsys.readouterr().out
    ratios = [h / o for h, o in zip((170, 100, 190), (200, 150, 180))]
    median = sorted(ratios)[1]
    assert abs(median - 170 / 180) > 0.05  # unlike the ratio of the two medians
    assert f"HTTP keeps {100 * median:.0f}% " in out
    assert ", ".join(f"{100 * x:.0f}%" for x in ratios) in out
    assert "| 170.0 | 170.0 100.0 190.0 |" in out  # the median, then every round


def test_without_the_offline_engine_there_is_no_ratio(capsys):
    print_table([Rows("raylane HTTP", [run(170)])], 64)
    assert "HTTP keeps" not in capsys.readouterr().out


def test_cpu_by_process_counts_a_child_s_cpu_under_its_name():
    import os
    import subprocess
    import sys

    from raylane.bench.process_cpu import THIS, ProcessCpu

    # the child spins for 0.3 s of CPU, says how much it used in all (the reference), and lives
    # on until the pass has ended
    spin = (
        "import sys, time\n"
        "while time.process_time() < 0.3: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()"
    )
    cpu = ProcessCpu()
    cmd = [sys.executable, "-c", spin]
    with cpu.timed():  # the child starts and spins inside the pass
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        used_by_child = float(child.stdout.readline())
    child.communicate("")  # let it exit
    counted = cpu.used[os.path.basename(sys.executable)]
    assert abs(counted - used_by_child) <= 0.06  # /proc accounts in 10 ms ticks
    assert THIS in cpu.used and cpu.wall_s >= 0.25  # it spun inside the pass
    assert "| process | CPU s |" in cpu.table(10, [])


def test_cpu_per_token_counts_the_server_and_not_the_load_generator():
    from raylane.bench.process_cpu import THIS, ProcessCpu

    cpu = ProcessCpu()
    cpu.used.update({THIS: 1.0, "ray::EngineReplica": 2.5, "ray::Router": 0.5})
    cpu.wall_s = 4.0
    offline = [RunResult(1.0, 100, 4, cpu_s=2.0)]  # 20 ms a token
    table = cpu.table(100, offline)  # HTTP: 3.0 server CPU s for 100 tokens, 30 ms a token
    assert "HTTP 30.0 ms, offline 20.0 ms (HTTP keeps 67% per CPU s)" in table
    assert "| ray::EngineReplica | 2.5 | 62.5% | 0.62 |" in table


def test_replica_threads_split_main_busiest_and_the_rest():
    import pytest
    from raylane.bench.process_cpu import _by_role

    before = {10: 1.0, 11: 5.0, 12: 0.5, 13: 0.1, 14: 0.0}
    after = {10: 1.5, 11: 9.0, 12: 2.5, 13: 0.3, 14: 0.2, -1: 10}  # pid 10: the main thread
    roles = _by_role(before, after)
    assert roles == {
        "main thread": 0.5,
        "busiest other thread (the runner)": 4.0,
        "2nd busiest other thread": 2.0,
        "all other threads": pytest.approx(0.4),
    }


def test_torch_threads_apply_to_the_offline_engine_too(tiny_llama_dir):
    import torch
    from raylane.bench.serve import OfflineEngine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        OfflineEngine(tiny_llama_dir, 2, [("river", 2)], torch_threads=1)
        assert torch.get_num_threads() == 1  # as the replica's, not all cores
    finally:
        torch.set_num_threads(before)
