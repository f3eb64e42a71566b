"""What the trainer protocols ask of one rank's weights and KV cache, besides serving: a checksum
of every parameter (vLLM's /weight_checker, SGLang's /weights_checker), overwriting them with
seeded noise (their "reset", to prove a later transfer restores them), and freeing the KV cache
while the engine sleeps (/sleep, /wake_up)."""

from __future__ import annotations

import hashlib

import torch
from raylane.actors.models.packing import repack_changed


def weight_checksums(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each parameter's bytes on this rank (its slice), by parameter name."""
    return {name: _digest(p) for name, p in model.named_parameters()}


def _digest(p: torch.Tensor) -> str:
    raw = p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


@torch.no_grad()
def reset_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded noise (N(0, 0.02^2)); packs are rebuilt."""
    gen = torch.Generator().manual_seed(seed)
    names = set()
    for name, p in model.named_parameters():
        p.copy_((0.02 * torch.randn(p.shape, generator=gen)).to(p.dtype))
        names.add(name)
    repack_changed(model, names)


def release_kv_cache(layers, dtype: torch.dtype, device: torch.device) -> None:
    """Point every attention layer at empty cache tensors, so the old ones are freed."""
    for layer in layers:
        layer.attach_cache(
            [torch.empty((0, *shape), dtype=dtype, device=device) for shape in layer.cache_shapes()]
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the freed blocks back to the device
