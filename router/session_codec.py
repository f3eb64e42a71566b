"""A session as JSON: what a durable `SessionStore` keeps so a restarted Router carries on.

Token ids are JSON lists; logprobs are base64 little-endian float64 (exact, and JSON has no
-inf); a routed-expert blob is base64 little-endian int32 with its shape. A record whose blob
was dropped (superseded: see `SessionConfig.blob_window`) stores none, so the stored copy is
O(prefix) like the live one. Loss masks are not stored: they follow from the records (prompt
ids masked out, output ids in), as `merge_trajectory` builds them. `model` names the served
model that made the session; rows stored before it was recorded lack it (they still load, and
a Router before it ignores it, so the format stays 1).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np
from raylane.actors.engine.sampling_params import (
    DATA_FIELDS,
    SamplingParams,
    StructuredOutputsParams,
)
from raylane.router.session import Session
from raylane.router.trajectory import Trajectory, TurnRecord

FORMAT = 1  # bump when the layout changes; `decode_session` refuses formats it does not know
_PARAM_NAMES = frozenset(DATA_FIELDS)


def encode_session(session: Session) -> dict[str, Any]:
    """JSON-ready (`json.dumps(..., allow_nan=False)` accepts it)."""
    return {
        "format": FORMAT,
        "id": session.id,
        "metadata": session.metadata,
        "model": session.model,
        "created_at": session.created_at,
        "last_used": session.last_used,
        "records": [_encode_record(r) for r in session.trajectory.records],
    }


def decode_session(data: dict[str, Any]) -> Session:
    if data.get("format") != FORMAT:
        raise ValueError(
            f"stored session format {data.get('format')!r}; this Router reads format {FORMAT}"
        )
    trajectory = Trajectory()
    trajectory.records = [_decode_record(r) for r in data["records"]]
    # "model" is absent from sessions stored before they recorded it (then None: unknown)
    return Session(
        data["id"],
        data["metadata"],
        created_at=data["created_at"],
        trajectory=trajectory,
        last_used=data["last_used"],
        model=data.get("model"),
    )


def _encode_record(r: TurnRecord) -> dict[str, Any]:
    experts = None
    if r.routed_experts is not None:
        experts = {"data": _b64(r.routed_experts, "<i4"), "shape": list(r.routed_experts.shape)}
    return {
        "new_messages": r.new_messages,
        "reply": r.reply,
        "params": _encode_params(r.params),
        "tools": r.tools,
        "prefix_len": r.prefix_len,
        "prompt_ids": r.prompt_ids,
        "output_ids": r.output_ids,
        "logprobs": _b64(r.logprobs, "<f8"),
        "finish_reason": r.finish_reason,
        "weight_version": r.weight_version,
        "routed_experts": experts,
        "blobs_dropped": r.blobs_dropped,
        "indexer_topk": _encode_blob(r.indexer_topk),
    }


def _decode_record(d: dict[str, Any]) -> TurnRecord:
    experts = d["routed_experts"]
    if experts is not None:
        # a writable copy, as the engine hands blobs out (frombuffer over bytes is read-only)
        experts = _unb64(experts["data"], "<i4").astype(np.int32).reshape(experts["shape"])
    return TurnRecord(
        new_messages=d["new_messages"],
        reply=d["reply"],
        params=_decode_params(d["params"]),
        prefix_len=d["prefix_len"],
        prompt_ids=d["prompt_ids"],
        output_ids=d["output_ids"],
        logprobs=_unb64(d["logprobs"], "<f8").tolist(),
        finish_reason=d["finish_reason"],
        weight_version=d["weight_version"],
        routed_experts=experts,
        tools=d["tools"],
        blobs_dropped=d["blobs_dropped"],
        indexer_topk=_decode_blob(d.get("indexer_topk")),  # absent in records stored before
    )


def _encode_blob(blob: np.ndarray | None) -> dict[str, Any] | None:
    return None if blob is None else {"data": _b64(blob, "<i4"), "shape": list(blob.shape)}


def _decode_blob(blob: dict[str, Any] | None) -> np.ndarray | None:
    if blob is None:
        return None
    return _unb64(blob["data"], "<i4").astype(np.int32).reshape(blob["shape"])


def _encode_params(params: SamplingParams) -> dict[str, Any]:
    data = {name: getattr(params, name) for name in _PARAM_NAMES}
    if params.structured_outputs is not None:
        data["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return data


def _decode_params(data: dict[str, Any]) -> SamplingParams:
    # names a newer or older SamplingParams lacks are skipped: the record's ids are the truth
    known = {k: v for k, v in data.items() if k in _PARAM_NAMES}
    if known.get("structured_outputs") is not None:
        known["structured_outputs"] = StructuredOutputsParams(**known["structured_outputs"])
    return SamplingParams(**known)


def _b64(values: Any, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unb64(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)
