"""vLLM's tokens-in / tokens-out route, `POST /inference/v1/generate`: token ids and vLLM's own
`sampling_params` in; per sample the token ids, logprobs in the chat shape with
`"token_id:<id>"` tokens, the finish reason and routed experts (base64 of a `.npy` int32
array, as vLLM sends them) out, with usage and the weight version beside them (its label, as
the trainer named it; in every streamed chunk too)."""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from raylane.actors.engine.outputs import CompletionOutput, EngineCoreOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server import formatting as fmt
from raylane.session_server.backend import ModelInfo
from raylane.session_server.context import backend_of, new_id, timeout_of
from raylane.session_server.errors import bad_request
from raylane.session_server.lora import model_adapter, on_adapter
from raylane.session_server.openapi import EVENT_STREAM, ok
from raylane.session_server.sampling import resolve_max_tokens, structured_spec
from raylane.session_server.streaming import final_outputs, primed, sse_response, start
from raylane.session_server.trainer_api.common import SAMPLING_FIELDS, labels_of
from raylane.session_server.trainer_api.schemas import TokensRequest, TokensResponse
from raylane.session_server.weight_labels import WeightLabels

router = APIRouter(tags=["vLLM RL API"])
control = APIRouter(tags=["vLLM RL API"])

_FIELDS = SAMPLING_FIELDS - {
    "return_routed_experts",  # vLLM returns them whenever the server captures them
    "structured_outputs",
    "cache_salt",  # the body's
}
# fields vLLM's SamplingParams carries that change nothing here (a client that serializes a
# whole vLLM SamplingParams sends them all)
_INERT = {"detokenize", "output_kind", "spaces_between_special_tokens", "skip_clone"}


@router.post(
    "/inference/v1/generate", response_model=None, responses=ok(TokensResponse, EVENT_STREAM)
)
async def generate(body: TokensRequest, request: Request):
    request_id = body.request_id or new_id("generate-tokens")
    params, stream = await start_tokens(body, request, request_id)
    labels = labels_of(request)
    stream = labels.resolved(stream)
    if body.stream:  # vLLM's chunks: each sample's new token ids (and logprobs)
        chunks = _Chunks(request_id, params, labels)
        return sse_response(await primed(request, stream), chunks.of, chunks.tail)
    out = (await final_outputs(request, stream, 1))[0]
    return {
        "request_id": request_id,
        "choices": [_choice(c, params, body.routed_experts_start_len) for c in out.outputs],
        "prompt_logprobs": fmt.vllm_prompt_logprobs(backend_of(request).tokenizer, out)
        if params.prompt_logprobs is not None
        else None,
        "kv_transfer_params": None,
        "usage": fmt.usage([out]),
        "weight_version": labels.known(out.weight_version),
    }


async def start_tokens(body: TokensRequest, request: Request, request_id: str) -> tuple:
    """Check a tokens request and start it: (its SamplingParams, the output stream). `model`
    may name a LoRA adapter (SkyRL's tenants), `lora_version` one of its versions (as on the
    OpenAI routes: 409 once it is no longer held; absent: the newest)."""
    backend = backend_of(request)
    lora = await model_adapter(request, body.model, body.lora_version)
    if body.features is not None:
        raise bad_request("features: multimodal inputs are not served here", "features")
    if body.routed_experts_start_len > len(body.token_ids):
        raise bad_request("routed_experts_start_len: past the prompt", "routed_experts_start_len")
    params = vllm_params(body.sampling_params, body.token_ids, backend.info)
    params = dataclasses.replace(params, cache_salt=body.cache_salt)
    timeout = timeout_of(request, None)
    stream = start(on_adapter(backend, lora), [body.token_ids], params, request_id, None, timeout)
    return params, stream


def vllm_params(sp: dict[str, Any], prompt: list[int], info: ModelInfo) -> SamplingParams:
    """vLLM's `sampling_params` (its names are raylane's) as the engine's; a field raylane
    cannot honour is a 400 naming it, and one that changes nothing is ignored."""
    unknown = [k for k, v in sp.items() if k not in _FIELDS | _INERT | {"structured_outputs"}]
    unknown = [k for k in unknown if sp[k] not in (None, False, [], {}, "")]
    if unknown:
        name = f"sampling_params.{unknown[0]}"
        raise bad_request(f"{name}: not supported by raylane", name)
    fields = {k: v for k, v in sp.items() if k in _FIELDS and v is not None}
    fields["max_tokens"] = resolve_max_tokens(
        fields.get("max_tokens"), [prompt], info, "sampling_params.max_tokens", "token_ids"
    )
    structured = sp.get("structured_outputs")
    spec = structured_spec(dict(structured), "structured_outputs") if structured else None
    return SamplingParams(
        **fields, return_routed_experts=info.routed_experts, structured_outputs=spec
    )


class _Chunks:
    """Streamed answers: one chunk per sample with news, then usage."""

    def __init__(self, request_id: str, params: SamplingParams, labels: WeightLabels):
        self.request_id, self.params, self.labels = request_id, params, labels
        self.prompt_tokens = self.completion_tokens = self.cached = 0
        self.version = 0  # of the last output: the tail's

    def of(self, _: int, out: EngineCoreOutput) -> list[dict]:
        self.version = out.weight_version
        version = self.labels.known(out.weight_version)
        if out.prompt_token_ids is not None:
            self.prompt_tokens, self.cached = len(out.prompt_token_ids), out.num_cached_tokens
        chunks = []
        for d in out.outputs:
            self.completion_tokens += len(d.token_ids)
            if not d.token_ids and not d.finished:
                continue
            sample = CompletionOutput(d.index, "", d.token_ids, d.logprobs, d.top_logprobs)
            choice = {
                "index": d.index,
                "logprobs": _logprobs(sample, self.params.logprobs)
                if self.params.logprobs is not None
                else None,
                "finish_reason": d.finish_reason,
                "token_ids": list(d.token_ids),
            }
            chunks.append(
                {"request_id": self.request_id, "choices": [choice], "weight_version": version}
            )
        return chunks

    def tail(self) -> list[dict]:
        usage = fmt.usage_of(self.prompt_tokens, self.completion_tokens, self.cached)
        version = self.labels.known(self.version)
        tail = {"request_id": self.request_id, "choices": [], "usage": usage}
        return [{**tail, "weight_version": version}]


def _choice(c: CompletionOutput, params: SamplingParams, start_len: int) -> dict:
    return {
        "index": c.index,
        "logprobs": _logprobs(c, params.logprobs) if params.logprobs is not None else None,
        "finish_reason": c.finish_reason or "stop",
        "token_ids": list(c.token_ids),
        "routed_experts": _npy(c.routed_experts[start_len:])
        if c.routed_experts is not None
        else None,
    }


def _logprobs(c: CompletionOutput, num_top: int) -> dict:
    """vLLM's: each token as "token_id:<id>"; its top list starts with the sampled token and
    then the most likely ones, `max(num_top, 1)` entries."""
    content = []
    for i, token in enumerate(c.token_ids):
        lp = fmt.finite((c.logprobs or [])[i])
        ranked = {token: lp, **dict(sorted((c.top_logprobs or [{}])[i].items(), key=_desc))}
        tops = list(ranked.items())[: max(num_top, 1)]
        content.append(
            {
                "token": f"token_id:{token}",
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [
                    {"token": f"token_id:{t}", "logprob": fmt.finite(v), "bytes": None}
                    for t, v in tops
                ],
            }
        )
    return {"content": content}


def _desc(item: tuple[int, float]) -> float:
    return -item[1]


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=np.int32))
    return base64.b64encode(buffer.getvalue()).decode("ascii")
