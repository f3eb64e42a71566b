"""The engine core: configuration, sampling parameters, and the offline and async engines."""

from __future__ import annotations

from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.actors.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from raylane.actors.lora.request import LoRARequest


def __getattr__(name: str):
    # the engines import torch; keep `from raylane.actors.engine import SamplingParams` light
    if name == "LLMEngine":
        from raylane.actors.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from raylane.actors.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
