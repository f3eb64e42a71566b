"""Build and load the CPU C kernels: one plain C file (no torch headers) per library, compiled
once per machine and loaded with ctypes.

A shared object is cached under `$RAYLANE_KERNEL_CACHE` (default `~/.cache/raylane/kernels`) in
a directory named by a hash of the source, the shared headers (kernels/csrc/*.h), the compiler
and its flags, and the CPU flags of this machine (`-march=native` code must not run on another
CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  NOTE: loaded before any library, see load_library

INCLUDE_DIR = Path(__file__).parent / "csrc"
# no -ffast-math: results must not depend on the compiler reassociating float math
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", f"-I{INCLUDE_DIR}"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_math.h's DTYPE_*


def load_library(source: Path) -> ctypes.CDLL:
    """The compiled `source`, built first unless this machine already has it; raises on failure."""
    # NOTE: torch is imported first (top of this module), so the library's libgomp.so.1
    # resolves to the copy torch already loaded: one OpenMP thread pool, not two
    # competing for the cores (a torch built on Intel's libiomp5 would still get two)
    return ctypes.CDLL(str(_build(source)))


def _build(source_path: Path) -> Path:
    """Path of the shared object, compiling it first unless this machine already has it."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    headers = [h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    parts = [source_path.read_bytes(), *headers, compiler.encode(), " ".join(_FLAGS).encode()]
    key = hashlib.sha256(b"\0".join([*parts, _cpu_flags().encode()])).hexdigest()[:16]
    root = os.environ.get("RAYLANE_KERNEL_CACHE") or Path.home() / ".cache/raylane/kernels"
    target = Path(root) / key / f"{source_path.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # several processes may build at once: each compiles to its own name in the same directory
    # and renames it into place, so nobody ever loads a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, str(source_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed:\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache dir needs it readable
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
