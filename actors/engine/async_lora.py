"""`AsyncEngineLoRA`: `AsyncLLMEngine`'s multi-LoRA verbs, on the loop's thread between steps
(a step in flight is folded in first, its outputs fanned out), over the `LLMEngine`'s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from raylane.actors.engine.llm_engine import LLMEngine
    from raylane.actors.engine.outputs import EngineCoreOutput
    from raylane.actors.lora import LoRAInfo, LoRARequest
    from raylane.actors.models.weights import Payload, TensorSpec


class AsyncEngineLoRA:
    engine: LLMEngine

    def _fan_out(self, outputs: list[EngineCoreOutput]) -> None:
        raise NotImplementedError  # AsyncLLMEngine's

    def _settled(self) -> LLMEngine:
        """The engine with no step in flight (what one computed is fanned out)."""
        self._fan_out(self.engine.drain())
        return self.engine

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> bool:
        return self._settled().add_lora(lora_request, pinned)

    def remove_lora(self, name: str, wait: bool = True) -> bool:
        return self._settled().remove_lora(name, wait)

    def pin_lora(self, name: str) -> bool:
        return self._settled().pin_lora(name)

    def list_loras(self) -> list[LoRAInfo]:
        return self.engine.list_loras()

    def update_lora(
        self,
        name: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
    ) -> int:
        return self._settled().update_lora(name, named_tensors, version)

    def begin_lora_update(self, name: str, specs: list[TensorSpec]) -> None:
        self.engine.begin_lora_update(name, specs)

    def load_lora_bucket(self, bucket: Payload | dict[str, Any]) -> int:
        return self.engine.load_lora_bucket(bucket)

    def finish_lora_update(self, version: int | str | None = None) -> int:
        return self._settled().finish_lora_update(version)

    def abort_lora_update(self) -> None:
        self.engine.abort_lora_update()
