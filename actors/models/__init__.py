"""Model definitions and loading: HF directory or GGUF file -> torch module matching HF."""

from __future__ import annotations

from raylane.actors.models.checkpoint import LazyTensor, ReadStats
from raylane.actors.models.layers import TPGroup
from raylane.actors.models.loader import load_model, load_tokenizer, load_weights, resolve_model_dir
from raylane.actors.models.packing import pack_linear_weights, unpack_linear_weights
from raylane.actors.models.registry import get_model_class, supported_architectures
from raylane.actors.models.tp_shape import check_tp_shape

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
