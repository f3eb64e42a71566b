"""`python -m benchmarks NAME [options]`, from the repository root (README.md lists them)."""

from __future__ import annotations

import argparse
import importlib
import sys

from raylane.cli import add_subcommands

# name -> module; each has add_arguments(parser) and run(args), imported only when it runs
BENCHMARKS = {
    "throughput": (
        "benchmarks.throughput",
        "`raylane bench throughput`, plus --json-schema, --json-object and the op table of "
        "--batch-invariant",
    ),
    "decode": (
        "benchmarks.decode",
        "decode tok/s: CUDA graphs vs eager vs transformers generate, by batch size",
    ),
    "step": ("benchmarks.step", "per-step time split: in-process vs Ray executor vs TP sizes"),
    "spec-step": (
        "benchmarks.spec_step",
        "speculative decoding at batch 1: one decode step vs one verify step, part by part",
    ),
    "hybrid": (
        "benchmarks.hybrid",
        "hybrid / windowed models: tok/s vs transformers; state memory per sequence",
    ),
    "sessions": ("benchmarks.sessions", "session registry memory with blob dropping on/off"),
    "consolidation": ("benchmarks.consolidation", "consolidation actor parallelism"),
    "channel-bytes": (
        "benchmarks.channel_bytes",
        "bytes per output token the replica's output channel sends, on the serve workload",
    ),
    "cache-versions": (
        "benchmarks.cache_versions",
        "prefix cache at a weight update: fold vs flush vs no protection",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="raylane's developer benchmarks (benchmarks/README.md); the ones users run "
        "are `raylane bench`.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    add_subcommands(sub, BENCHMARKS, [w for w in argv if not w.startswith("-")][:1])
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
