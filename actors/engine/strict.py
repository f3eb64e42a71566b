"""A decorator that turns unknown or mistyped constructor fields into a `ValueError`."""

from __future__ import annotations

import dataclasses
import difflib
import functools


def strict_fields(cls):
    """Wrap a dataclass's `__init__` so an unknown keyword names itself and its closest match."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                hint = difflib.get_close_matches(key, names, n=1)
                extra = f"; did you mean {hint[0]!r}?" if hint else f"; known fields: {names}"
                raise ValueError(f"{cls.__name__}: unknown field {key!r}{extra}")
        if len(args) > len(names):
            raise ValueError(f"{cls.__name__}: takes at most {len(names)} positional fields")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def check_type(owner: str, name: str, value, types: type | tuple[type, ...]) -> None:
    """Raise `ValueError` when `value` is not one of `types` (bool never passes for int/float)."""
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"{owner}.{name} must be {_names(types)}, got bool")
    if not isinstance(value, types):
        raise ValueError(f"{owner}.{name} must be {_names(types)}, got {type(value).__name__}")


def _names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)
