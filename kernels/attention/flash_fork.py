"""Finding vLLM's flash-attention fork: `vllm.vllm_flash_attn` inside vLLM's wheel, else the
standalone `vllm_flash_attn` package, whichever imports and reports a usable FA version.

Nothing here is a dependency: the standalone package stopped at 2.6.2 (built for torch 2.4), so
the fork usually comes with a vLLM wheel built for the installed torch. A missing fork is a
reason string, never an import error at raylane's import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# in order of preference: the fork vLLM builds for its own torch, then the old standalone one
MODULES = ("vllm.vllm_flash_attn", "vllm_flash_attn")
HOW_TO_GET = (
    "install vLLM's wheel built for your torch (it bundles the fork as vllm.vllm_flash_attn; "
    "see the `gpu` extra in pyproject.toml)"
)


class FlashForkMissing(RuntimeError):
    """No usable fork: the message names what is missing and how to get it."""


@dataclass(frozen=True)
class FlashFork:
    module: str  # the import name that worked
    varlen: Callable[..., Any]  # its flash_attn_varlen_func
    fa_version: int  # 2 (SM80+) or 3 (SM90)


def find_flash_fork(device: torch.device) -> FlashFork:
    """The first of `MODULES` that imports and supports FA3 (Hopper) or FA2 on `device`, as
    vLLM's get_flash_attn_version picks; raises FlashForkMissing with every module's reason."""
    if device.type != "cuda":
        raise FlashForkMissing(f"flash_attn needs a CUDA device, not {device}")
    reasons = []
    for name in MODULES:
        try:
            return _probe(name, device)
        except FlashForkMissing as e:
            reasons.append(f"{name}: {e}")
    raise FlashForkMissing(
        f"vLLM's flash-attention fork is not usable ({'; '.join(reasons)}); {HOW_TO_GET}"
    )


def _probe(name: str, device: torch.device) -> FlashFork:
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a broken CUDA build raises OSError, not ImportError
        raise FlashForkMissing(f"does not import ({type(e).__name__}: {e})") from e
    supported = getattr(module, "is_fa_version_supported", None)
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if supported is None or varlen is None:  # releases before 2.7 (the PyPI 2.6.2 among them)
        raise FlashForkMissing("reports no FA version (an old release)")
    # Hopper prefers FA3; FA2 runs on SM80 and later (vLLM's order)
    major = torch.cuda.get_device_capability(device)[0]
    for version in (3, 2) if major == 9 else (2,):
        if supported(version):
            return FlashFork(name, varlen, version)
    why = getattr(module, "fa_version_unsupported_reason", lambda v: "unsupported")(2)
    raise FlashForkMissing(f"FA2 is not supported on this device ({why})")
