"""The consolidation actor: fold agents' memories in PostgreSQL into observations."""

from __future__ import annotations

from .config import ConsolidationConfig, ConsolidationServiceConfig
from .consolidator import Consolidator
from .errors import BankBusy, CallFailed, CommitConflict, ConsolidationError, InvalidAnswer
from .llm import LLM, EngineLLM, OpenAICompatibleLLM
from .metrics import ConsolidationMetrics
from .perf import BatchPerf, ConsolidationResult
from .store import MemoryStore

__all__ = [
    "LLM",
    "BankBusy",
    "BatchPerf",
    "CallFailed",
    "CommitConflict",
    "ConsolidationConfig",
    "ConsolidationError",
    "ConsolidationMetrics",
    "ConsolidationResult",
    "ConsolidationServiceConfig",
    "Consolidator",
    "EngineLLM",
    "InvalidAnswer",
    "MemoryStore",
    "OpenAICompatibleLLM",
]
