"""A session opened on a LoRA adapter: `metadata["lora"]` names it, and every turn of the
session runs on it (the turn generator's `lora`), so a tenant's conversation stays on its
adapter without naming it each turn. A turn may ask for one version of it (`lora_version`, as
on the OpenAI routes: a version no longer held is the engine's `LoRAVersionGone`, 409)."""

from __future__ import annotations

from typing import Any

from raylane.actors.replica_lora import versioned

SESSION_LORA_KEY = "lora"


def session_lora(metadata: dict[str, Any]) -> str | None:
    """The adapter a session's metadata names (None: the base model)."""
    name = metadata.get(SESSION_LORA_KEY)
    return name if isinstance(name, str) and name else None


def on_lora(lora: str | None, version: int | None = None) -> dict[str, Any]:
    """The generator keyword for a turn on `lora` at `version` (None: its newest); none for
    the base model, so generators that know no adapters are called as before."""
    if lora is None:
        if version is not None:
            raise ValueError(
                "lora_version: this session runs on the base model; a version is asked of the "
                "adapter a session is opened on (metadata.lora)"
            )
        return {}
    return {"lora": versioned(lora, version)}
