"""Streaming a request's outputs between processes as deltas, not cumulative copies.

The engine hands out cumulative `RequestOutput`s (every token so far). Shipped as they are from
an engine replica to the ingress, step k of a request carries k tokens, logprobs, versions and
routed-expert rows: O(L^2) bytes pickled and sent for L tokens. `DeltaEncoder` (replica side)
keeps only what each sample gained since the last output; `DeltaDecoder` (caller side) rebuilds
the cumulative outputs the rest of the code expects. Text is sent whole (the detokenizer may
rewrite its tail, e.g. when a stop string is trimmed) — it is small next to the lists.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput

_LISTS = ("token_ids", "logprobs", "top_logprobs", "weight_versions", "kept_mass_logprobs")


class DeltaEncoder:
    """Turns a request's cumulative outputs into deltas (one encoder per request)."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, str], int] = {}  # (sample index, field) -> items sent

    def encode(self, out: RequestOutput) -> RequestOutput:
        prompt = self._new(-1, "prompt_logprobs", out.prompt_logprobs)
        return dataclasses.replace(
            out, outputs=[self._completion(c) for c in out.outputs], prompt_logprobs=prompt
        )

    def _completion(self, c: CompletionOutput) -> CompletionOutput:
        news = {name: self._new(c.index, name, getattr(c, name)) for name in _LISTS}
        return dataclasses.replace(
            c, routed_experts=self._new(c.index, "routed_experts", c.routed_experts), **news
        )

    def _new(self, index: int, name: str, values):
        """The items of a growing list (or array rows) not sent yet; None stays None."""
        if values is None:
            return None
        start = self._sent.get((index, name), 0)
        self._sent[index, name] = len(values)
        return values[start:]


class DeltaDecoder:
    """Rebuilds cumulative outputs from an encoder's deltas (one decoder per request). Each
    output it returns is a fresh object; earlier ones are left as they were."""

    def __init__(self) -> None:
        self._acc: dict[int, CompletionOutput] = {}
        self._prompt: list | None = None

    def decode(self, delta: RequestOutput) -> RequestOutput:
        self._prompt = _joined(self._prompt, delta.prompt_logprobs)
        return dataclasses.replace(
            delta,
            outputs=[self._completion(c) for c in delta.outputs],
            prompt_logprobs=self._prompt,
        )

    def _completion(self, d: CompletionOutput) -> CompletionOutput:
        prev = self._acc.get(d.index)
        if prev is None:
            full = dataclasses.replace(d)
        else:
            lists = {name: _joined(getattr(prev, name), getattr(d, name)) for name in _LISTS}
            experts = d.routed_experts
            if prev.routed_experts is not None and experts is not None:
                experts = np.concatenate([prev.routed_experts, experts])
            elif experts is None:
                experts = prev.routed_experts
            full = dataclasses.replace(d, routed_experts=experts, **lists)
        self._acc[d.index] = full
        return full


def _joined(before: list | None, new: list | None) -> list | None:
    """A new list when there is something new; otherwise the one before (never mutated)."""
    if before is None:
        return None if new is None else list(new)
    return before + new if new else before
