"""The `raylane` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

# bench name -> module under cluster/bench; each module has add_arguments(parser) and run(args),
# imported only when that bench is run. The developers' benchmarks (decode, step, hybrid, ...)
# are not installed: benchmarks/ in a checkout, `python -m benchmarks --help` (its README.md).
BENCHES = {
    "throughput": ("raylane.bench.throughput", "offline engine vs transformers generate"),
    "serve": ("raylane.bench.serve", "HTTP endpoint vs the offline engine and transformers serve"),
    "spec": (
        "raylane.bench.spec",
        "speculative decoding: decode tok/s off vs ngram vs suffix, by workload and batch size",
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
    add_subcommands(sub, COMMANDS, words[:1])
    bench = sub.add_parser(
        "bench",
        help=f"run a benchmark and print a table ({', '.join(BENCHES)})",
        description="Benchmarks print a table with a reference measured in the same run, so "
        f"ratios are comparable across machines: {', '.join(BENCHES)}. `raylane bench serve` "
        "needs the bench extra: pip install 'raylane[bench]'. The developers' benchmarks "
        "(decode, step, hybrid, sessions, ...) run from a checkout: python -m benchmarks "
        "--help (benchmarks/README.md).",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    add_subcommands(bench_sub, BENCHES, words[1:2] if words[:1] == ["bench"] else [])
    return parser


def add_subcommands(sub, table: dict[str, tuple[str, str]], chosen: list[str]) -> None:
    """One subcommand per `table` entry (name -> (module, help)); only the `chosen` one (a
    list of at most one name, as typed) imports its module to add its arguments."""
    for name, (module, help_text) in table.items():
        parser = sub.add_parser(name, help=help_text, description=help_text)
        parser.set_defaults(_module=module)
        if chosen == [name]:
            importlib.import_module(module).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
