"""Merge a session's turn records into one training sample, and (de)serialise it.

tokens            every turn's new prompt ids then its output ids, laid end to end
loss_mask         1 on generated ids, 0 on template, user, tool and injected-assistant ids
rollout_logprobs  the sampled token's raw logprob where the mask is 1, else 0.0
routed_experts    the last turn's blob, int32 [len(tokens) - 1, moe_layers, top_k], or None:
                  routing at a position depends only on the ids before it, so the last turn's
                  forward pass covers the whole trajectory (and any cut of it)
indexer_topk      DSA models: likewise the last turn's indexer top-k blob, int32
                  [len(tokens) - 1, dsa_layers, index_topk], or None
weight_versions   one per turn, so a trainer can drop or reweight off-policy turns
status            "aborted" when the last turn was, "truncated" when it hit max_tokens or
                  `max_seq_len` cut turns off, else "completed"
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from raylane.router.errors import MalformedTrajectory
from raylane.router.trajectory import TurnRecord


@dataclass
class TrainingSample:
    tokens: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    routed_experts: np.ndarray | None
    weight_versions: list[int]
    status: str
    indexer_topk: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: lists, and the routed experts as base64 int32 plus their shape."""
        out = {
            "tokens": self.tokens,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "routed_experts": _blob(self.routed_experts),
            "weight_versions": self.weight_versions,
            "status": self.status,
        }
        if self.indexer_topk is not None:
            out["indexer_topk"] = _blob(self.indexer_topk)
        return out

    def to_safetensors(self) -> bytes:
        """tokens int64, loss_mask int8, rollout_logprobs float32, routed_experts int32 (absent
        when None), weight_versions int64; `status` in the header metadata."""
        from safetensors.numpy import save

        tensors: dict[str, np.ndarray] = {
            "tokens": np.asarray(self.tokens, dtype=np.int64),
            "loss_mask": np.asarray(self.loss_mask, dtype=np.int8),
            "rollout_logprobs": np.asarray(self.rollout_logprobs, dtype=np.float32),
            "weight_versions": np.asarray(self.weight_versions, dtype=np.int64),
        }
        for name in ("routed_experts", "indexer_topk"):
            blob = getattr(self, name)
            if blob is not None:
                tensors[name] = np.ascontiguousarray(blob, dtype=np.int32)
        return save(tensors, metadata={"status": self.status})

    @classmethod
    def from_safetensors(cls, data: bytes) -> TrainingSample:
        from safetensors.numpy import load

        tensors = load(data)
        # the format: 8-byte little-endian header length, then the JSON header
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        return cls(
            tokens=tensors["tokens"].tolist(),
            loss_mask=tensors["loss_mask"].tolist(),
            rollout_logprobs=tensors["rollout_logprobs"].tolist(),
            routed_experts=tensors.get("routed_experts"),
            weight_versions=tensors["weight_versions"].tolist(),
            status=header["__metadata__"]["status"],
            indexer_topk=tensors.get("indexer_topk"),
        )


def merge_trajectory(
    records: Sequence[TurnRecord], max_seq_len: int | None = None
) -> TrainingSample:
    """One sample from a session's records; `MalformedTrajectory` says why when it can't."""
    _check_records(records)
    kept = _cut(records, max_seq_len)
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for r in kept:
        tokens += r.prompt_ids
        tokens += r.output_ids
        mask += [0] * len(r.prompt_ids) + [1] * len(r.output_ids)
        logprobs += [0.0] * len(r.prompt_ids) + list(r.logprobs)
    last = kept[-1]
    cut = len(kept) < len(records)
    status = (
        "aborted"
        if last.finish_reason == "abort"
        else "truncated"
        if cut or last.finish_reason == "length"
        else "completed"
    )
    experts, picks = records[-1].routed_experts, records[-1].indexer_topk
    return TrainingSample(
        tokens,
        mask,
        logprobs,
        None if experts is None else experts[: len(tokens) - 1],
        [r.weight_version for r in kept],
        status,
        None if picks is None else picks[: len(tokens) - 1],
    )


def _blob(array: np.ndarray | None) -> dict[str, Any] | None:
    """An int32 array as base64 plus its shape (None stays None)."""
    if array is None:
        return None
    data = np.ascontiguousarray(array, dtype=np.int32)
    return {"data": base64.b64encode(data.tobytes()).decode("ascii"), "shape": list(data.shape)}


def _check_records(records: Sequence[TurnRecord]) -> None:
    if not records:
        raise MalformedTrajectory("the session has no turns to merge")
    expected = 0
    for i, r in enumerate(records):
        if r.prefix_len != expected:
            raise MalformedTrajectory(
                f"turn {i} starts at token {r.prefix_len} but the turns before it end at {expected}"
            )
        if len(r.logprobs) != len(r.output_ids):
            raise MalformedTrajectory(
                f"turn {i} has {len(r.output_ids)} output ids but {len(r.logprobs)} logprobs"
            )
        expected = r.end
    last = records[-1]
    if last.blobs_dropped:
        raise MalformedTrajectory("the last turn's routed experts were dropped")
    experts = last.routed_experts
    if experts is not None and (experts.ndim != 3 or experts.shape[0] != last.end - 1):
        raise MalformedTrajectory(
            f"the last turn's routed experts have shape "
            f"{list(experts.shape)}; expected [{last.end - 1}, layers, "
            f"top_k] (one row per token but the last)"
        )
    picks = last.indexer_topk
    if picks is not None and (picks.ndim != 3 or picks.shape[0] != last.end - 1):
        raise MalformedTrajectory(
            f"the last turn's indexer top-k has shape {list(picks.shape)}; expected "
            f"[{last.end - 1}, layers, index_topk] (one row per token but the last)"
        )


def _cut(records: Sequence[TurnRecord], max_seq_len: int | None) -> Sequence[TurnRecord]:
    """The longest run of whole turns that fits in `max_seq_len` tokens."""
    if max_seq_len is None or records[-1].end <= max_seq_len:
        return records
    fits = [r for r in records if r.end <= max_seq_len]
    if not fits:
        raise MalformedTrajectory(
            f"the first turn alone is {records[0].end} tokens, more than "
            f"max_seq_len={max_seq_len}, so no turn boundary fits"
        )
    return records[: len(fits)]
