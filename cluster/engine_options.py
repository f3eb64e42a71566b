"""`EngineOptions`: the `engine:` section of a cluster config, checked against `EngineConfig`
when the config loads (an unknown key names itself and its closest match; a bad value fails
as `EngineConfig` fails it), then read-only. It holds only the keys given, so a replica's
`EngineConfig` keeps the engine's defaults for the rest, and merging sections key by key (a
flag over the YAML, a RayService's args over the file) stays a dict merge."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from raylane.actors.engine.config import EngineConfig

# every EngineConfig field but the model, which is the cluster's
KNOWN = sorted(f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name != "model")
PLACEHOLDER_MODEL = "<embedded>"  # what the values are checked with before a model is chosen


class EngineOptions(Mapping[str, Any]):
    """`EngineConfig` options (vLLM names) for every replica; `None` is none."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(
                f"ClusterConfig.engine must be a mapping of EngineConfig options, "
                f"got {type(options).__name__}"
            )
        _check_names(options)
        self._options = dict(options)
        self.config(PLACEHOLDER_MODEL)  # a bad value fails here, not in a replica

    def config(self, model: str) -> EngineConfig:
        """The `EngineConfig` one replica of `model` runs with."""
        return EngineConfig(model=model, **self._options)

    def __getitem__(self, key: str) -> Any:
        return self._options[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def __repr__(self) -> str:
        return f"EngineOptions({self._options!r})"

    def __reduce__(self) -> tuple:
        return EngineOptions, (self._options,)


def _check_names(options: Mapping[str, Any]) -> None:
    unknown = sorted(str(key) for key in options if key not in KNOWN)
    if not unknown:
        return
    hints = [
        f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)
        for key in unknown
        for close in [difflib.get_close_matches(key, KNOWN, n=1)]
    ]
    raise ValueError(f"ClusterConfig.engine: unknown option(s) {', '.join(hints)}; known: {KNOWN}")
