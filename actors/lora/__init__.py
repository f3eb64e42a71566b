"""Multi-LoRA: adapters in PEFT's format served beside the base model, several in one step.

Engine side (torch-free): `LoRARequest`, the errors, `LoRARegistry` (adapters, versions,
slots). Runner side: `adapter.py` (reading a PEFT directory), `layer_lora.py` (the math in
each linear layer), `model_lora.py` (a model's slots)."""

from raylane.actors.lora.errors import (
    LoRAError,
    LoRAInUse,
    LoRANotFound,
    LoRASlotsFull,
    LoRAVersionGone,
)
from raylane.actors.lora.registry import LoRABinding, LoRAInfo, LoRARegistry
from raylane.actors.lora.request import LoRARequest

__all__ = [
    "LoRABinding",
    "LoRAError",
    "LoRAInUse",
    "LoRAInfo",
    "LoRANotFound",
    "LoRARegistry",
    "LoRARequest",
    "LoRASlotsFull",
    "LoRAVersionGone",
]
