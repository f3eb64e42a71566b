"""`raylane bench serve`: streaming clients against the HTTP endpoint, with references.

Runs a fixed seeded chat workload through N concurrent streaming clients and reports
requests/s, output tokens/s, TTFT and inter-token latency. In the same run it measures the
offline engine on the same prompts (the ceiling the HTTP path should keep 85% of) and,
with `--transformers`, `transformers serve --continuous-batching` on the same model.
`--prompt-words` makes the prompts long. Needs the bench extra (aiohttp, psutil):
`pip install 'raylane[bench]'`.

The HTTP/offline ratio is taken in paired rounds (`--rounds`): each round runs the offline
engine, then a fresh endpoint, on that round's own workload, one right after the other. These
machines' speed drifts by more than 10% within minutes (other tenants), so a ratio of two runs
minutes apart measures the drift as much as the serving path; the median of paired rounds does
not. Offline runs only while no Ray process is up: an idle local cluster alone slows the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING

from raylane.bench.extra import require_extra
from raylane.bench.serve_load import RunResult, drive, make_workload
from raylane.bench.serve_table import Rows, print_table

if TYPE_CHECKING:
    from raylane.bench.process_cpu import ProcessCpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload_arguments(parser)
    _add_system_arguments(parser)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running endpoint (default: start one in-process)")
    parser.add_argument("--model", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--prompt-words",
        type=int,
        nargs=2,
        default=[3, 40],
        metavar=("MIN", "MAX"),
        help="words per prompt (long prompts: e.g. 2000 2000, about 2 tokens a word)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="paired rounds (offline engine, then a fresh endpoint, each on the "
        "round's own workload); the ratio reported is their median",
    )


def _add_system_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-offline", action="store_true", help="skip the offline engine")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads of the engine replica and of the offline engine (default: all cores)",
    )
    parser.add_argument(
        "--serve-proxy",
        action="store_true",
        help="the in-process endpoint answers through Ray Serve's proxy "
        "(`raylane serve --no-direct-ingress`) instead of its ingress "
        "replica's own HTTP server",
    )
    parser.add_argument(
        "--cpu-by-process",
        action="store_true",
        help="also report CPU seconds per process of the bench's own endpoint over the timed "
        "passes (raylane/bench/process_cpu.py)",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also run `transformers serve --continuous-batching` as a reference",
    )


class OfflineEngine:
    """The same requests through LLMEngine.generate, at most `concurrency` running at once. Built
    and warmed once (`warm`), before any Ray process starts."""

    def __init__(
        self,
        model_dir: str,
        concurrency: int,
        warm: list[tuple[str, int]],
        torch_threads: int | None = None,
    ):
        import torch
        from raylane.actors.engine import EngineConfig, LLMEngine

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=concurrency))
        self.run(warm)

    def run(self, work: list[tuple[str, int]]) -> RunResult:
        from raylane.actors.engine import SamplingParams

        prompts = [
            self.engine.validator.render_chat([{"role": "user", "content": p}]) for p, _ in work
        ]
        params = [SamplingParams(temperature=0, max_tokens=n) for _, n in work]
        start, cpu = time.perf_counter(), time.process_time()
        outs = self.engine.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return RunResult(wall, tokens, len(work), cpu_s=cpu)


def round_work(args: argparse.Namespace, k: int) -> tuple[list, list]:
    """Round k's measured workload and its untimed warm-up pass (the same shape, other words):
    a fresh server's (and engine's) first steps pay one-time costs, e.g. oneDNN compiling a
    kernel for each new batch shape, that the measured runs should not. Fresh prompts every
    round, so neither system answers from a prefix cache an earlier round filled."""
    seed = args.seed + 2 * k
    size, words = (args.requests, tuple(args.max_tokens)), tuple(args.prompt_words)
    return make_workload(*size, seed, words), make_workload(*size, seed + 1, words)


def run(args: argparse.Namespace) -> int:
    require_extra("raylane bench serve", "aiohttp", "psutil")
    from raylane.bench.process_cpu import ProcessCpu
    from raylane.models import resolve_model

    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    model_dir = resolve_model(args.model)
    offline = None
    if not args.skip_offline:
        offline = OfflineEngine(model_dir, args.clients, round_work(args, 0)[1], args.torch_threads)
    cpu = ProcessCpu()
    how = ", Serve's proxy" if args.serve_proxy else ""
    http = Rows(f"raylane HTTP ({args.clients} clients{how})")
    off = Rows(f"raylane offline LLMEngine (max_num_seqs={args.clients})")
    for k in range(args.rounds):
        run_round(args, k, model_dir, offline, (http, off), cpu)
    rows = [http] + ([off] if off.runs else [])
    if args.transformers:
        rows.append(transformers_row(args, model_dir))
    print_table(rows, args.requests)
    if args.cpu_by_process:
        print(cpu.table(sum(r.output_tokens for r in http.runs), off.runs))
    return 0


def run_round(
    args: argparse.Namespace,
    k: int,
    model_dir: str,
    offline: OfflineEngine | None,
    rows: tuple[Rows, Rows],
    cpu: ProcessCpu,
) -> None:
    """Round k: the offline engine (if any), then a fresh endpoint, on the round's workload;
    each adds its run to its row (http, off)."""
    import psutil
    from raylane.bench.serve_targets import raylane_endpoint

    http, off = rows
    work, warm = round_work(args, k)
    if offline is not None:
        off.runs.append(offline.run(work))
    with raylane_endpoint(
        args.url, model_dir, args.torch_threads, False if args.serve_proxy else None
    ) as (url, name):
        started = psutil.Process().children(recursive=True)
        asyncio.run(drive(url, name, warm, args.clients))
        with cpu.timed():
            http.runs.append(asyncio.run(drive(url, name, work, args.clients)))
    # the next offline run shares the CPU with none of Ray's processes
    psutil.wait_procs(started, timeout=60)
    print(
        f"round {k + 1}/{args.rounds}: HTTP {http.runs[-1].tok_s:.1f} tok/s"
        + (f", offline {off.runs[-1].tok_s:.1f}" if off.runs else ""),
        flush=True,
    )


def transformers_row(args: argparse.Namespace, model_dir: str) -> Rows:
    """`transformers serve --continuous-batching` on round 0's workload, after its warm-up."""
    from raylane.bench.serve_targets import transformers_endpoint

    work, warm = round_work(args, 0)
    ref = Rows(f"transformers serve --cb ({args.clients} clients)")
    with transformers_endpoint(model_dir) as (url, name):
        asyncio.run(drive(url, name, warm, args.clients))
        ref.runs.append(asyncio.run(drive(url, name, work, args.clients)))
    return ref
