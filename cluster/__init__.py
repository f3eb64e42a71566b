"""raylane: a Ray-distributed rollout and serving cluster for LLMs.

    from raylane import LLMEngine, EngineConfig, SamplingParams, AsyncLLMEngine, RolloutClient

The names load on first use, so `import raylane.kernels` (or the CLI's `--help`) does not pull in
torch, Ray and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "LLMEngine": "raylane.actors.engine.llm_engine",
    "AsyncLLMEngine": "raylane.actors.engine.async_engine",
    "EngineConfig": "raylane.actors.engine.config",
    "SamplingParams": "raylane.actors.engine.sampling_params",
    "StructuredOutputsParams": "raylane.actors.engine.sampling_params",
    "RequestOutputKind": "raylane.actors.engine.sampling_params",
    "RequestOutput": "raylane.actors.engine.outputs",
    "CompletionOutput": "raylane.actors.engine.outputs",
    "RolloutClient": "raylane.client.rollout_client",
    "ClusterConfig": "raylane.config",
    "batch_invariant": "raylane.on_policy",
    "LoRARequest": "raylane.actors.lora.request",
}

if TYPE_CHECKING:
    from raylane.actors.engine.async_engine import AsyncLLMEngine
    from raylane.actors.engine.config import EngineConfig
    from raylane.actors.engine.llm_engine import LLMEngine
    from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
    from raylane.actors.engine.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )
    from raylane.actors.lora.request import LoRARequest
    from raylane.client.rollout_client import RolloutClient
    from raylane.config import ClusterConfig
    from raylane.on_policy import batch_invariant


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylane' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "AsyncLLMEngine",
    "ClusterConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "RolloutClient",
    "SamplingParams",
    "StructuredOutputsParams",
    "batch_invariant",
]
