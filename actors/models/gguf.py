"""GGUF files -> cached Hugging Face directories (converted once by transformers, dequantized).

The cache key is the file's absolute path, size and mtime, so a replaced file converts again.
Conversion writes into a temporary folder and renames it into place under a file lock, so
concurrent processes (test workers, Ray actors) never see a half-written directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

_DONE = ".raylane-complete"


def cache_root() -> Path:
    """`$RAYLANE_CACHE_DIR`, else `$XDG_CACHE_HOME/raylane`, else `~/.cache/raylane`."""
    if os.environ.get("RAYLANE_CACHE_DIR"):
        return Path(os.environ["RAYLANE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raylane"


def converted_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the HF directory for this GGUF file lives (whether or not converted yet)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gguf_to_hf_dir(gguf_path: str | os.PathLike, log: Callable[[str], None] = _stderr) -> str:
    """Return a cached HF directory (config, float32 safetensors, tokenizer) for a GGUF file."""
    path = Path(gguf_path)
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    target = converted_dir(path)
    if (target / _DONE).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: another process may have converted meanwhile
        if not (target / _DONE).exists():
            log(
                f"raylane: converting {path.name} to a Hugging Face directory once "
                f"(dequantizing, ~10 s); cached at {target}"
            )
            started = time.monotonic()
            _convert(path.resolve(), target)
            log(f"raylane: converted in {time.monotonic() - started:.1f} s")
    return str(target)


def _convert(path: Path, target: Path) -> None:
    if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError(
            "loading a GGUF file needs the `gguf` and `accelerate` packages: "
            "pip install gguf accelerate"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(path.parent), path.name
    quant = GgufConfig(gguf_file=str(path), dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, quantization_config=quant)
    model.save_pretrained(tmp)
    del model
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    (tmp / _DONE).touch()
    shutil.rmtree(target, ignore_errors=True)  # a stale, incomplete earlier attempt
    os.rename(tmp, target)
