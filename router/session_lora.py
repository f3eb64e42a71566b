"""A session opened on a LoRA adapter: `metadata["lora"]` names it, and every turn of the
session runs on it (the turn generator's `lora`), so a tenant's conversation stays on its
adapter without naming it each turn."""

from __future__ import annotations

from typing import Any

SESSION_LORA_KEY = "lora"


def session_lora(metadata: dict[str, Any]) -> str | None:
    """The adapter a session's metadata names (None: the base model)."""
    name = metadata.get(SESSION_LORA_KEY)
    return name if isinstance(name, str) and name else None


def on_lora(lora: str | None) -> dict[str, Any]:
    """The generator keyword for a turn on `lora` (none for the base model, so generators
    that know no adapters are called as before)."""
    return {} if lora is None else {"lora": lora}
