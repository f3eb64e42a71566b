"""The engine's adapter errors (`raylane.actors.lora.errors`) as the HTTP surface answers them,
in vLLM's shapes: an unknown adapter is vLLM's unknown-model 404 ("The model `x` does not
exist.", type NotFoundError), a replaced version or an adapter still in use 409, every slot
pinned 429. Found without importing the engine's LoRA package (a module nobody imported cannot
have raised one)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_QUOTED = re.compile(r"['`\"]([^'`\"]+)['`\"]")


@dataclass(frozen=True)
class LoRAHTTPError:
    status: int
    message: str
    type: str
    param: str | None
    code: int


def unknown_model(name: str) -> LoRAHTTPError:
    """vLLM's answer to a `model` it does not serve (an adapter it does not hold included)."""
    return LoRAHTTPError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", 404)


def lora_http_error(error: BaseException) -> LoRAHTTPError | None:
    """The HTTP answer to a `LoRAError`; None for anything else."""
    errors = sys.modules.get("raylane.actors.lora.errors")
    if errors is None or not isinstance(error, errors.LoRAError):
        return None
    message = str(error)
    if isinstance(error, errors.LoRANotFound):
        named = getattr(error, "name", None) or _QUOTED.search(message)
        if named is None:
            return LoRAHTTPError(404, message, "NotFoundError", "model", 404)
        return unknown_model(named if isinstance(named, str) else named.group(1))
    if isinstance(error, errors.LoRASlotsFull):
        return LoRAHTTPError(429, message, "RateLimitError", None, 429)
    if isinstance(error, (errors.LoRAVersionGone, errors.LoRAInUse)):
        return LoRAHTTPError(409, message, "ConflictError", "model", 409)
    return LoRAHTTPError(400, message, "BadRequestError", None, 400)
