"""The bench extra: what `raylane bench serve` needs beyond raylane's own dependencies."""

from __future__ import annotations

import importlib

INSTALL = "pip install 'raylane[bench]'"


def require_extra(command: str, *modules: str) -> None:
    """Exit with the install line when one of `modules` does not import."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(f"`{command}` needs {', '.join(missing)}, in the bench extra: {INSTALL}")
