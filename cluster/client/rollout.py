"""`Rollout`: one generated sample as a trainer consumes it, in plain Python and numpy.

The same dataclass comes out of both transports: built from the engine's `RequestOutput` in the
cluster, or from a `/generate` answer item over HTTP (whose JSON floors -inf logprobs to -9999
and carries routed experts as base64 int32; both are undone here, so the transports agree).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass

import numpy as np
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput

_JSON_FLOOR = -9999.0  # what the HTTP layer sends for a -inf logprob


@dataclass
class Rollout:
    request_id: str
    index: int  # the sample's index within its request (n > 1)
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort" or "stale"
    logprobs: list[float] | None  # raw logprob of each token (temperature 1, no truncation)
    weight_versions: list[int]  # the weights' version that produced each token
    weight_version: int = 0  # the engine's version when the output was made
    top_logprobs: list[dict[int, float]] | None = None
    kept_mass_logprobs: list[float] | None = None  # log of the mass truncation kept, per token
    routed_experts: np.ndarray | None = None  # int32 [prompt + output - 1, moe_layers, top_k]
    num_cached_tokens: int = 0
    # DSA models: int32 [prompt + output - 1, dsa_layers, index_topk], ascending, -1 padded
    indexer_topk: np.ndarray | None = None
    lora_versions: list[int] | None = None  # the adapter's version of each token (None: base)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def from_request_output(out: RequestOutput) -> list[Rollout]:
    """One rollout per sample of an engine output (in-cluster)."""
    return [_from_completion(out, c) for c in out.outputs]


def _from_completion(out: RequestOutput, c: CompletionOutput) -> Rollout:
    return Rollout(
        request_id=out.request_id,
        index=c.index,
        prompt_token_ids=list(out.prompt_token_ids),
        token_ids=list(c.token_ids),
        text=c.text,
        finish_reason=c.finish_reason,
        logprobs=None if c.logprobs is None else [float(x) for x in c.logprobs],
        weight_versions=[int(v) for v in c.weight_versions],
        weight_version=out.weight_version,
        top_logprobs=None if c.top_logprobs is None else [dict(t) for t in c.top_logprobs],
        kept_mass_logprobs=None if c.kept_mass_logprobs is None else list(c.kept_mass_logprobs),
        routed_experts=c.routed_experts,
        num_cached_tokens=out.num_cached_tokens,
        indexer_topk=c.indexer_topk,
        lora_versions=None if c.lora_versions is None else [int(v) for v in c.lora_versions],
    )


def from_generate_item(
    item: dict, prompt_token_ids: list[int] | None = None, request_id: str | None = None
) -> Rollout:
    """A rollout from one item of a `/generate` answer (HTTP)."""
    meta = item.get("meta_info") or {}
    ids = [int(t) for t in item.get("output_ids") or []]
    version = _version(meta)
    return Rollout(
        request_id=request_id or meta.get("id", ""),
        index=int(item.get("index", 0)),
        prompt_token_ids=list(prompt_token_ids or []),
        token_ids=ids,
        text=item.get("text", ""),
        finish_reason=_finish_type(meta.get("finish_reason")),
        logprobs=_logprobs(meta.get("output_token_logprobs")),
        weight_versions=[int(v) for v in meta.get("weight_versions") or []],
        weight_version=version,
        top_logprobs=_top_logprobs(meta.get("output_top_logprobs")),
        kept_mass_logprobs=_floats(meta.get("kept_mass_logprobs")),
        routed_experts=decode_routed_experts(
            meta.get("routed_experts"), meta.get("routed_experts_shape")
        ),
        num_cached_tokens=int(meta.get("cached_tokens") or 0),
        indexer_topk=decode_routed_experts(meta.get("indexer_topk")),
        lora_versions=_ints(meta.get("lora_versions")),
    )


def _ints(values: list | None) -> list[int] | None:
    return None if values is None else [int(v) for v in values]


def _version(meta: dict) -> int:
    """raylane's integer version. With the trainer API on, `weight_version` is SGLang's
    string, a label a trainer may have given ("step-42", or "7" for raylane's 2): then the
    integer is that of the last token (the engine's when the output was made)."""
    given = meta.get("weight_version")
    if isinstance(given, int):
        return given
    per_token = meta.get("weight_versions") or []
    return int(per_token[-1]) if per_token else 0


def decode_routed_experts(
    blob: dict | str | None, shape: list[int] | None = None
) -> np.ndarray | None:
    """`{"data": base64 little-endian int32, "shape": [...]}` -> an int32 array; or SGLang's
    base64 string, with the shape the server sends beside it (`routed_experts_shape`, when
    the trainer API is on)."""
    if blob is None:
        return None
    if isinstance(blob, str):
        blob = {"data": blob, "shape": shape}
    data = np.frombuffer(base64.b64decode(blob["data"]), dtype="<i4")
    return data.astype(np.int32).reshape(blob["shape"])


def unfloor(logprob: float) -> float:
    return -math.inf if logprob <= _JSON_FLOOR else float(logprob)


def _finish_type(reason: dict | str | None) -> str | None:
    if reason is None or isinstance(reason, str):
        return reason
    return reason.get("type")


def _logprobs(triples: list[list] | None) -> list[float] | None:
    """SGLang's `[logprob, token_id, text]` triples -> the logprobs."""
    if triples is None:
        return None
    return [unfloor(t[0]) for t in triples]


def _top_logprobs(per_token: list[list[list]] | None) -> list[dict[int, float]] | None:
    if per_token is None:
        return None
    return [{int(t[1]): unfloor(t[0]) for t in triples} for triples in per_token]


def _floats(values: list[float] | None) -> list[float] | None:
    return None if values is None else [unfloor(v) for v in values]


@dataclass
class SessionTurn:
    """One session turn as the rollout client returns it (`Session.chat`)."""

    message: dict  # the assistant message the session stored: echo it back next turn
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    weight_version: int = 0
