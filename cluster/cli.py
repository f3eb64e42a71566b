"""The `raylane` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

# bench name -> module under cluster.bench; each module has add_arguments(parser) and run(args).
BENCHES = {
    "throughput": ("cluster.bench.throughput", "offline engine vs transformers generate"),
    "consolidation": ("cluster.bench.consolidation", "consolidation actor parallelism"),
}

# command name -> module under cluster; each module has add_arguments(parser) and run(args).
COMMANDS = {
    "generate": ("cluster.generate", "generate text offline with the engine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raylane",
        description="raylane: a Ray-distributed rollout and serving cluster for LLMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(cmd)
    bench = sub.add_parser("bench", help="run a benchmark and print a table",
                           description="Benchmarks print a table with a reference measured in "
                                       "the same run, so ratios are comparable across machines.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        b = bench_sub.add_parser(name, help=help_text, description=help_text)
        b.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(b)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
