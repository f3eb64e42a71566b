"""Model definitions and loading: HF directory or GGUF file -> torch module matching HF.

The names load on first use: `raylane.actors.models.weights` (the wire format of weight updates)
is torch-free, and the Router, which reads it, must not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "LazyTensor": "checkpoint",
    "ReadStats": "checkpoint",
    "TPGroup": "layers",
    "load_model": "loader",
    "load_tokenizer": "loader",
    "load_weights": "loader",
    "resolve_model_dir": "loader",
    "pack_linear_weights": "packing",
    "unpack_linear_weights": "packing",
    "get_model_class": "registry",
    "supported_architectures": "registry",
    "check_tp_shape": "tp_shape",
}

if TYPE_CHECKING:
    from raylane.actors.models.checkpoint import LazyTensor, ReadStats
    from raylane.actors.models.loader import (
        load_model,
        load_tokenizer,
        load_weights,
        resolve_model_dir,
    )
    from raylane.actors.models.packing import pack_linear_weights, unpack_linear_weights
    from raylane.actors.models.registry import get_model_class, supported_architectures
    from raylane.actors.models.tp_group import TPGroup
    from raylane.actors.models.tp_shape import check_tp_shape


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylane.actors.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LazyTensor",
    "ReadStats",
    "TPGroup",
    "check_tp_shape",
    "get_model_class",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "pack_linear_weights",
    "resolve_model_dir",
    "supported_architectures",
    "unpack_linear_weights",
]
