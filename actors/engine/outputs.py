"""What the engine returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

T = TypeVar("T")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # raw logprob of each sampled token
    top_logprobs: list[dict[int, float]] | None = None
    # "stop", "length", "abort", "stale" (see SamplingParams.max_weight_lag), "error" (a step
    # failed: RequestOutput.error says why) or None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    routed_experts: np.ndarray | None = None  # int32 [prompt + output - 1, moe_layers, top_k]
    # DSA models: the positions each fed position's indexer chose per layer, ascending, -1
    # padded; int32 [prompt + output - 1, dsa_layers, index_topk]
    indexer_topk: np.ndarray | None = None
    weight_versions: list[int] = field(default_factory=list)  # one per token in token_ids
    kept_mass_logprobs: list[float] | None = None  # when SamplingParams.return_kept_mass
    # the LoRA adapter version that produced each token (None: a base-model request)
    lora_versions: list[int] | None = None
    # its tokens were drawn under a grammar's mask (structured outputs); `logprobs` are still
    # the model's own, taken before the mask
    constrained: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    weight_version: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # the rank (1 = most likely) of each prompt token under the model, beside its entry
    prompt_ranks: list[int | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the request failed (finish reason "error")


class CompactPickle:
    """Pickles a slotted dataclass as its field values, without their names: the deltas cross
    the replica's output channel every step, and a pickled slots object spells out every field
    name (which would make each new field, even one left None, cost bytes per step)."""

    __slots__ = ()

    def __getstate__(self) -> tuple:
        names: tuple[str, ...] = self.__slots__
        return tuple(getattr(self, name) for name in names)

    def __setstate__(self, state: tuple) -> None:
        names: tuple[str, ...] = self.__slots__
        for name, value in zip(names, state, strict=True):
            object.__setattr__(self, name, value)


@dataclass(slots=True)
class SampleDelta(CompactPickle):
    """What one sample gained in one engine step (see `EngineCoreOutput`)."""

    index: int
    text: str  # new text; held back while it could still be the start of a stop string
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    weight_versions: list[int] = field(default_factory=list)
    kept_mass_logprobs: list[float] | None = None
    lora_versions: list[int] | None = None  # beside weight_versions; None: no adapter
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # the whole array, once: on the delta that finishes the sample (it is trimmed then)
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None  # likewise, once
    constrained: bool = False
    # the text held back so far (a few characters, with stop strings only): a caller that ends
    # the request itself (a deadline) shows it, as the engine's own final delta would
    held_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> CompletionOutput:
        """This delta as a `CompletionOutput` of its own (fresh lists)."""
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            logprobs=copy_list(self.logprobs),
            top_logprobs=copy_list(self.top_logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            routed_experts=self.routed_experts,
            indexer_topk=self.indexer_topk,
            weight_versions=list(self.weight_versions),
            kept_mass_logprobs=copy_list(self.kept_mass_logprobs),
            lora_versions=copy_list(self.lora_versions),
            constrained=self.constrained,
        )


@dataclass(slots=True)
class EngineCoreOutput(CompactPickle):
    """One request's news from one engine step, shaped like vLLM v1's `EngineCoreOutput`: only
    what is new, so a step's output is O(new tokens) whatever the prompt length. The prompt (text,
    ids) comes once, on the request's first output; `prompt_logprobs` holds the entries computed
    since the last output. `outputs` lists the samples with news (all of them on the first).
    `OutputAccumulator` folds these into the cumulative `RequestOutput`s."""

    request_id: str
    outputs: list[SampleDelta]
    finished: bool
    weight_version: int = 0
    num_cached_tokens: int = 0
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # first output only
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # the rank (1 = most likely) of each prompt token under the model, beside its entry
    prompt_ranks: list[int | None] | None = None
    metrics: dict[str, float] | None = None  # final output only
    error: str | None = None


def copy_list(values: list[T] | None) -> list[T] | None:
    return None if values is None else list(values)
