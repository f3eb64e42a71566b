"""The `raylane` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

# bench name -> module under cluster.bench; each module has add_arguments(parser) and run(args),
# imported only when that bench is run.
BENCHES = {
    "throughput": ("raylane.bench.throughput", "offline engine vs transformers generate"),
    "decode": (
        "raylane.bench.decode",
        "decode tok/s: CUDA graphs vs eager vs transformers generate, by batch size",
    ),
    "consolidation": ("raylane.bench.consolidation", "consolidation actor parallelism"),
    "sessions": ("raylane.bench.sessions", "session registry memory with blob dropping on/off"),
    "serve": ("raylane.bench.serve", "HTTP endpoint vs the offline engine and transformers serve"),
    "step": ("raylane.bench.step", "per-step time split: in-process vs Ray executor vs TP sizes"),
    "spec": (
        "raylane.bench.spec",
        "speculative decoding: decode tok/s off vs ngram vs suffix, by workload and batch size",
    ),
    "spec-step": (
        "raylane.bench.spec_step",
        "speculative decoding at batch 1: one decode step vs one verify step, part by part",
    ),
    "hybrid": (
        "raylane.bench.hybrid",
        "hybrid / windowed models: tok/s vs transformers; state memory per sequence",
    ),
    "weights": (
        "raylane.bench.weights",
        "weight update GB/s over HTTP and in-cluster vs a copy; pause -> update -> resume latency",
    ),
}

# command name -> module under cluster; each module has add_arguments(parser) and run(args).
COMMANDS = {
    "generate": ("raylane.generate", "generate text offline with the engine"),
    "serve": ("raylane.serve_cli", "serve a model over an OpenAI-compatible HTTP endpoint"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the command named in `argv` imports its module (fast, isolated)."""
    words = [w for w in (argv or []) if not w.startswith("-")]
    parser = argparse.ArgumentParser(
        prog="raylane",
        description="raylane: a Ray-distributed rollout and serving cluster for LLMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        _attach(cmd, module, selected=words[:1] == [name])
    bench = sub.add_parser(
        "bench",
        help="run a benchmark and print a table",
        description="Benchmarks print a table with a reference measured in "
        "the same run, so ratios are comparable across machines.",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        b = bench_sub.add_parser(name, help=help_text, description=help_text)
        _attach(b, module, selected=words[:2] == ["bench", name])
    return parser


def _attach(parser: argparse.ArgumentParser, module: str, selected: bool) -> None:
    parser.set_defaults(_module=module)
    if selected:
        importlib.import_module(module).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
