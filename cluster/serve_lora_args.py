"""`raylane serve`'s LoRA flags, in vLLM's shapes: --enable-lora, --max-loras, --max-lora-rank,
--max-cpu-loras, and --lora-modules (`name=path`, or vLLM's JSON form `{"name", "path",
"base_model_name"}`), the adapters every replica loads at start."""

from __future__ import annotations

import argparse
import json
from typing import Any

ENGINE_FLAGS = ("max_loras", "max_lora_rank", "max_cpu_loras")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (docs/serving.md)")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters: a request's `model` may name one (/v1/models lists them), "
        "and vLLM's and SGLang's load/unload routes are on",
    )
    group.add_argument(
        "--max-loras", type=int, metavar="N", help="adapters in one batch at once (default 4)"
    )
    group.add_argument(
        "--max-lora-rank", type=int, metavar="R", help="the highest adapter rank (default 16)"
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        metavar="N",
        help="adapters kept registered in host memory (default: --max-loras)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help="adapters to load at start: name=path (a PEFT directory), or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; implies --enable-lora',
    )


def lora_module(text: str) -> dict[str, Any]:
    """One --lora-modules entry as {"name", "path"[, "base_model_name"]}."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: expected name=path")
        entry = {"name": name, "path": path}
    try:
        return check_module(entry)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_module(entry: Any) -> dict[str, Any]:
    """A `lora_modules` entry, checked: {"name", "path"} non-empty strings, and optionally
    vLLM's "base_model_name"."""
    if not isinstance(entry, dict):
        raise ValueError(f"lora_modules: each entry is {{name, path}}, got {entry!r}")
    unknown = set(entry) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"lora_modules: unknown key(s) {sorted(unknown)}")
    for key in ("name", "path"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"lora_modules: each entry needs a non-empty {key!r}")
    return dict(entry)


def lora_options(args: argparse.Namespace, engine: dict) -> dict[str, Any]:
    """The config updates the LoRA flags ask for (engine options into `engine`, in place)."""
    if args.enable_lora or args.lora_modules:
        engine["enable_lora"] = True
    for name in ENGINE_FLAGS:
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    return {"lora_modules": tuple(args.lora_modules)} if args.lora_modules else {}
