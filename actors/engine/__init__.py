"""The engine core: configuration, sampling parameters, and the offline and async engines."""

from __future__ import annotations

from actors.engine.config import EngineConfig
from actors.engine.outputs import CompletionOutput, RequestOutput
from actors.engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # the engines import torch; keep `from actors.engine import SamplingParams` light
    if name == "LLMEngine":
        from actors.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from actors.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
