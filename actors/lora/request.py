"""`LoRARequest`: which adapter a request runs on (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name. `lora_path` is a PEFT directory (adapter_config.json,
    adapter_model.safetensors); it may be empty for a name already registered. `version`
    (raylane's): run on that version of the adapter, not the newest (LoRAVersionGone once
    it is no longer held)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}"
            )
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest.lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path must be a str, got {self.lora_path!r}")
        if self.version is not None and (
            isinstance(self.version, bool) or not isinstance(self.version, int)
        ):
            raise ValueError(f"LoRARequest.version must be an int or None, got {self.version!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def as_lora_list(
    lora_request: LoRARequest | list[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter for every prompt, or a list with one per prompt (vLLM's generate)."""
    if not isinstance(lora_request, list):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(
            f"lora_request: {len(lora_request)} given for {count} prompts (one per prompt)"
        )
    return lora_request
