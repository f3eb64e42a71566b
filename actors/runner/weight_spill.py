"""`WeightSpill`: a rank's weights released for a level-2 sleep and restored at wake-up.

The rank's parameters (its own TP slices, whatever version they hold) are written to a
safetensors file on local disk and every parameter's storage, and its oneDNN pack, is
released; `restore` reads them back onto the device and re-packs. Reloading the checkpoint
instead would bring back version 0's weights under a later version's label.
"""

from __future__ import annotations

import os
import tempfile

import torch
from raylane.actors.models.packing import pack_linear_weights, unpack_linear_weights
from safetensors.torch import load_file, save_file
from torch import nn


class WeightSpill:
    def __init__(self) -> None:
        self.path: str | None = None  # the spilled weights; None: the model holds them
        self._packed = False

    @property
    def released(self) -> bool:
        return self.path is not None

    def release(self, model: nn.Module) -> None:
        """Write every parameter to a file, then free its storage (idempotent)."""
        if self.path is not None:
            return
        params = dict(model.named_parameters())  # a tied parameter once
        fd, path = tempfile.mkstemp(prefix="raylane-weights-", suffix=".safetensors")
        os.close(fd)
        save_file(_unshared(params), path)
        self._packed = any(getattr(m, "packed", None) is not None for m in model.modules())
        unpack_linear_weights(model)
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if next(iter(params.values())).device.type == "cuda":
            torch.cuda.empty_cache()
        self.path = path

    def restore(self, model: nn.Module) -> None:
        """Read the spilled parameters back onto their device (idempotent)."""
        if self.path is None:
            return
        params = dict(model.named_parameters())
        device = next(iter(params.values())).device
        loaded = load_file(self.path, device=str(device))
        for name, p in params.items():
            p.data = loaded[name]
        if self._packed:
            pack_linear_weights(model)
        os.remove(self.path)
        self.path = None


def _unshared(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """CPU tensors safetensors can write: a parameter that is a view into another's storage
    (a fused layout) is copied out, as safetensors refuses shared memory."""
    seen: set[int] = set()
    out = {}
    for name, p in params.items():
        t = p.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
