"""Build a model from a Hugging Face directory or a GGUF file and load its weights.

Checkpoint names are mapped to our fused parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj, per-expert weights -> 3-D expert tensors); each parameter's `weight_loader`
takes its tensor-parallel rank's slice. Safetensors tensors arrive as lazy views
(checkpoint.py), so a rank reads only the slices it keeps, never the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from raylane.actors.models.checkpoint import LazyTensor, ReadStats
from raylane.actors.models.gguf import gguf_to_hf_dir
from raylane.actors.models.layers import Loaded, copy_checked
from raylane.actors.models.packing import pack_linear_weights, refresh_packed_weights
from raylane.actors.models.registry import get_model_class
from raylane.actors.models.tp_group import TPGroup
from raylane.actors.models.tp_shape import check_tp_shape
from torch import nn

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_model_dir(path: str | os.PathLike) -> str:
    """An HF directory as is; a `.gguf` file -> its cached converted directory."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return gguf_to_hf_dir(p)
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model: {str(path)!r} is neither a Hugging Face directory with "
            "config.json nor a .gguf file"
        )
    return str(p)


def resolve_dtype(dtype: str | torch.dtype | None, config: Any) -> torch.dtype:
    """`"auto"` or None -> the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        if isinstance(dtype, torch.dtype):
            return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of 'auto', {sorted(_DTYPES)}")
    return _DTYPES[name]


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """Safetensors files (sharded via the index, or all in the folder); .bin as a fallback."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin files in {str(d)!r}")
    return files


def iter_checkpoint(
    model_dir: str | os.PathLike, stats: ReadStats | None = None
) -> Iterator[tuple[str, Loaded]]:
    """(name, tensor) pairs of a checkpoint, one tensor at a time.

    Safetensors files yield `LazyTensor` views that read nothing until a region of them is
    materialised (weight loaders narrow first, so each TP rank reads only its slices).
    `.bin` files cannot be read in part: they yield whole (memory-mapped) tensors, each
    counted whole in `stats`. `stats` collects the bytes read.
    """
    from safetensors import safe_open

    for file in checkpoint_files(model_dir):
        if file.suffix == ".bin":
            yield from _iter_bin(file, stats)
            continue
        # NOTE: a slice keeps the file mapped after the handle closes, so views outlive it
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, LazyTensor(f.get_slice(name), stats)


def _iter_bin(file: Path, stats: ReadStats | None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in torch.load(file, map_location="cpu", mmap=True, weights_only=True).items():
        if stats is not None:
            stats.add(tensor)
        yield name, tensor


def _target(
    model: nn.Module, experts: list[tuple[str, str, Any]], name: str
) -> tuple[str, Any] | None:
    """Checkpoint name -> (our parameter name, shard id), or None to skip the tensor."""
    if "rotary_emb.inv_freq" in name:
        return None
    rename = getattr(model, "rename_weight", None)  # a model's own name rules (e.g. MTP layers)
    if rename is not None and (name := rename(name)) is None:
        return None
    for old, new in getattr(model, "weight_renames", []):
        name = name.replace(old, new)
    if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
        return None  # tied to the embedding, which is loaded under its own name
    if ".experts." in name:
        for ours, theirs, shard in experts:
            if theirs in name:
                return name.replace(theirs, ours), shard
    for ours, theirs, shard in getattr(model, "stacked_params_mapping", []):
        if f".{theirs}." in name:
            return name.replace(f".{theirs}.", f".{ours}."), shard
    return name, None


def param_targets(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The names of the parameters these checkpoint tensors would write (`load_weights`'s own
    mapping), so a caller can save them first."""
    mapping = getattr(model, "expert_params_mapping", None)
    experts = mapping() if mapping is not None else []
    targets = (_target(model, experts, name) for name in names)
    return {t[0] for t in targets if t is not None}


def _plain_loader(param: nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
    copy_checked(param.data, loaded, "parameter")  # e.g. norm weights, whole on every rank


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, Loaded]], partial: bool = False
) -> set[str]:
    """Copy checkpoint tensors (or `LazyTensor` views) into `model`, each parameter taking its
    TP rank's slice; ValueError on unknown or missing weights and on shape mismatches.
    Returns the names of the parameters it wrote.

    `partial`: a bucket of a weight update: missing weights are fine, and the caller re-packs
    what changed (`repack_changed`).
    """
    params = dict(model.named_parameters())
    mapping = getattr(model, "expert_params_mapping", None)  # MoE models have one
    experts = mapping() if mapping is not None else []
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            target = _target(model, experts, name)
            if target is None:
                continue
            ours, shard = target
            if ours not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            param = params[ours]
            try:
                getattr(param, "weight_loader", _plain_loader)(param, tensor, shard)
            except ValueError as e:  # the loader's message names our parameter, not theirs
                raise ValueError(f"{name!r}: {e}") from None
            loaded.add(ours)
    if partial:
        return loaded
    prune = getattr(model, "prune_unloaded", None)  # optional parts the checkpoint lacks
    if prune is not None and prune(loaded):
        params = dict(model.named_parameters())
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
    refresh_packed_weights(model)
    return loaded


def check_weights(
    model_class: type,
    config: Any,
    tp: TPGroup,
    dtype: torch.dtype,
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
) -> None:
    """Run the weight loaders of a shape-only (meta) twin of the model on shape-only tensors:
    raises the ValueError a real load of those names and shapes would raise, and touches no
    weight. This is how an update is checked on every rank before any weight changes."""
    with _default_dtype(dtype), torch.device("meta"):
        twin = model_class(config, TPGroup(tp.rank, tp.world_size))
    seen: set[str] = set()
    for name, _, _ in specs:
        if name in seen:
            raise ValueError(f"tensors: {name!r} appears twice in the update")
        seen.add(name)
    fakes = ((name, torch.empty(shape, dtype=dt, device="meta")) for name, shape, dt in specs)
    load_weights(twin, fakes, partial=True)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    tp: TPGroup | None = None,
    pack_weights: bool = True,
    read_stats: ReadStats | None = None,
) -> tuple[nn.Module, Any, str]:
    """Build and load the model at `path` (HF directory or .gguf).

    `tp`: this rank's place in its tensor-parallel group; the shapes are checked first
    (`check_tp_shape`) and the rank reads only its slices of a safetensors checkpoint.
    `pack_weights`: on CPU in float32, pre-pack linear weights for oneDNN (about 2x faster
    decode matmuls, the linear weights' memory once more); ignored elsewhere.
    `read_stats`: if given, counts the checkpoint bytes this load read.
    Returns (model in eval mode, HF config, the HF directory it came from).
    """
    from transformers import AutoConfig

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir)
    cls = get_model_class(config)
    check_tp_shape(config, (tp or TPGroup()).world_size)
    torch_dtype = resolve_dtype(dtype, config)
    with _default_dtype(torch_dtype), torch.device(device):
        model = cls(config, tp)
    load_weights(model, iter_checkpoint(model_dir, read_stats))
    if pack_weights:
        pack_linear_weights(model)
    return model.eval(), config, model_dir


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of an HF directory (a model's, or a tokenizer's alone: no config.json
    needed) or a .gguf file (from its converted directory)."""
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        if not any((p / name).is_file() for name in _TOKENIZER_FILES):
            raise ValueError(f"tokenizer: {str(path)!r} holds no tokenizer ({_TOKENIZER_FILES})")
        return AutoTokenizer.from_pretrained(str(p))
    return AutoTokenizer.from_pretrained(resolve_model_dir(path))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
