"""Response pieces both APIs share: logprobs in OpenAI and SGLang shapes, usage, routed experts."""

from __future__ import annotations

import base64
import math

import numpy as np
from raylane.actors.engine.outputs import RequestOutput

_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this instead


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class TokenIds:
    """Stands in for the tokenizer where logprobs name their tokens, naming each
    "token_id:<id>" (vLLM's `return_tokens_as_token_ids`): ids survive where text is ambiguous
    (a byte-level piece that is not valid UTF-8 alone)."""

    def decode(self, token_ids: list[int], **_) -> str:
        return "".join(f"token_id:{t}" for t in token_ids)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[dict[int, float]],
    num_top: int,
) -> dict:
    """`choices[i].logprobs` of a chat completion: one entry per token with its top alternatives."""
    return {
        "content": [
            {
                **_chat_entry(tokenizer, t, lp),
                "top_logprobs": [_chat_entry(tokenizer, a, alp) for a, alp in _best(top, num_top)],
            }
            for t, lp, top in zip(token_ids, logprobs, tops)
        ]
    }


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[dict[int, float]],
    num_top: int,
    offset: int,
) -> dict:
    """`choices[i].logprobs` of a (legacy) completion; `offset` is where the first token's text
    starts in the choice's text."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(lp) for lp in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, a): finite(alp) for a, alp in _best(top, num_top)}
            for top in tops
        ],
        "text_offset": offsets,
    }


def sglang_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[float], with_text: bool
) -> list[list]:
    """SGLang's `[logprob, token_id, text or None]` triples."""
    return [
        [finite(lp), t, token_text(tokenizer, t) if with_text else None]
        for t, lp in zip(token_ids, logprobs)
    ]


def sglang_top_logprobs(
    tokenizer, tops: list[dict[int, float]], num_top: int, with_text: bool
) -> list[list[list]]:
    return [
        sglang_logprobs(tokenizer, [a for a, _ in best], [lp for _, lp in best], with_text)
        for best in (_best(top, num_top) for top in tops)
    ]


def _best(top: dict[int, float], num: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])[:num]


def routed_experts(array: np.ndarray | None) -> dict | None:
    """Routed expert ids (or a DSA model's indexer top-k positions) as base64 of
    little-endian int32 plus the array's shape."""
    if array is None:
        return None
    data = np.ascontiguousarray(array, dtype="<i4")
    return {"data": base64.b64encode(data.tobytes()).decode("ascii"), "shape": list(data.shape)}


def usage(finals: list[RequestOutput]) -> dict:
    """OpenAI usage over every prompt of a request and all of its choices."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return usage_of(prompt, completion, sum(o.num_cached_tokens for o in finals))


def usage_of(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI usage from token counts."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def vllm_prompt_logprobs(tokenizer, out: RequestOutput) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` of a `RequestOutput`: per prompt token (None for the first,
    which nothing precedes) its top-N and itself, keyed by the token id as a string, each
    `{logprob, rank, decoded_token}`; rank 1 is the most likely token."""
    ids = out.prompt_token_ids
    entries = list(out.prompt_logprobs or [])
    ranks = list(out.prompt_ranks or [])
    shown: list[dict[str, dict] | None] = []
    for i, token in enumerate(ids):
        entry = entries[i] if i < len(entries) else None  # None: ended before its prefill
        own_rank = ranks[i] if i < len(ranks) else None
        if entry is None:
            shown.append(None)
            continue
        ordered = sorted(entry.items(), key=lambda kv: -kv[1])  # the top-N, then the token
        shown.append(
            {
                str(t): {
                    "logprob": finite(lp),
                    # the top-N are ranks 1..N; the prompt token's own is counted on the runner
                    "rank": own_rank if t == token and own_rank is not None else k + 1,
                    "decoded_token": token_text(tokenizer, t),
                }
                for k, (t, lp) in enumerate(ordered)
            }
        )
    return shown
