"""LoRA errors. All are ValueErrors (bad engine input); the serving side maps each to its
HTTP status as vLLM does: LoRANotFound 404, LoRAVersionGone 409, LoRASlotsFull 429,
LoRAInUse 409. A bad adapter file or config raises a plain ValueError naming the field."""

from __future__ import annotations


class LoRAError(ValueError):
    """Base of the LoRA errors."""


class LoRANotFound(LoRAError):
    """No adapter of that name is registered."""


class LoRAVersionGone(LoRAError):
    """The adapter version a request asked for was replaced and is no longer held."""


class LoRASlotsFull(LoRAError):
    """Every one of the `max_loras` slots is pinned or serves requests in flight."""


class LoRAInUse(LoRAError):
    """Unloading an adapter that requests in flight still run on (the caller would not wait)."""
