"""SGLang-shaped /generate answers: `text`, `output_ids` and `meta_info` per sample.

Streamed chunks are cumulative as SGLang's (each holds everything so far), with `index` when a
request has several samples (built from the engine's deltas; the engine holds back text that a
stop string may still trim).

With the trainer API on (`labels` given) the answer is SGLang's exact one where raylane's own
differs: `weight_version` is a string (the label a trainer gave the version, else the integer;
`weight_versions` stay raylane's integers), and `routed_experts` is SGLang's base64 string of the
flattened int32 ids (its shape in `routed_experts_shape`, which SGLang's clients ignore). Either
way routed experts cover rows `[routed_experts_start_len, prompt + output - 1)`.
"""

from __future__ import annotations

from typing import Any

from raylane.actors.engine.output_accumulator import OutputAccumulator
from raylane.actors.engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.session_server import formatting as fmt
from raylane.session_server.schemas import GenerateRequest
from raylane.session_server.weight_labels import WeightLabels


def finish_reason(c: CompletionOutput) -> dict | None:
    """SGLang's finish reason; a stop by EOS names the EOS token as `matched`."""
    if c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        matched = c.stop_reason if c.stop_reason is not None else c.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    return {
        "type": c.finish_reason,
        "message": _MESSAGES.get(c.finish_reason, "the request was aborted"),
    }


_MESSAGES = {
    "stale": "the request's tokens would span more weight versions than its max_weight_lag allows"
}


def partial_items(outputs: list[RequestOutput]) -> list[dict]:
    """/generate-shaped items of requests ended early (an admin abort): one per sample."""
    return [
        {
            "text": c.text,
            "output_ids": list(c.token_ids),
            "index": c.index,
            "meta_info": {
                "id": out.request_id,
                "finish_reason": finish_reason(c),
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "cached_tokens": out.num_cached_tokens,
                "weight_version": out.weight_version,
                "weight_versions": list(c.weight_versions),
            },
        }
        for out in outputs
        for c in out.outputs
    ]


class NativeFormatter:
    def __init__(
        self,
        request_id: str,
        body: GenerateRequest,
        params: SamplingParams,
        tokenizer,
        num_prompts: int,
        labels: WeightLabels | None = None,
    ):
        self.id = request_id
        self.body = body
        self.params = params
        self.tokenizer = tokenizer
        self.num_prompts = num_prompts
        self.labels = labels  # versions' texts, every output's `known` already
        self.sglang = labels is not None  # SGLang's exact shape (the trainer API is on)
        self.accumulators: dict[int, OutputAccumulator] = {}  # streaming: by prompt index

    def items(self, finals: dict[int, RequestOutput]) -> list[dict]:
        """Prompt-major: every sample of prompt 0, then of prompt 1, ..."""
        return [
            self._item(i, finals[i], c, c.text) for i in sorted(finals) for c in finals[i].outputs
        ]

    def chunks(self, i: int, delta: EngineCoreOutput) -> list[dict]:
        acc = self.accumulators.setdefault(i, OutputAccumulator())
        acc.add(delta)
        out = acc.live()  # SGLang's chunks are cumulative
        news = {d.index for d in delta.outputs if d.text or d.token_ids or d.finished}
        return [self._item(i, out, c, c.text) for c in out.outputs if c.index in news]

    def _item(self, i: int, out: RequestOutput, c: CompletionOutput, text: str) -> dict:
        item: dict[str, Any] = {
            "text": text,
            "output_ids": list(c.token_ids),
            "meta_info": self._meta(i, out, c),
        }
        if self.num_prompts > 1 or self.params.n > 1:
            item["index"] = i * self.params.n + c.index
        return item

    def _meta(self, i: int, out: RequestOutput, c: CompletionOutput) -> dict:
        meta: dict[str, Any] = {
            "id": self.id if self.num_prompts == 1 else f"{self.id}-{i}",
            "finish_reason": finish_reason(c),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "weight_version": self.labels.known(out.weight_version)
            if self.labels is not None
            else out.weight_version,
            "weight_versions": list(c.weight_versions),  # of each output token
            "routed_experts": None,
        }
        if c.lora_versions is not None:  # the LoRA adapter's version of each output token
            meta["lora_versions"] = list(c.lora_versions)
        if self.body.return_routed_experts:
            meta.update(self._routing(c))
        if self.body.return_indexer_topk:
            meta["indexer_topk"] = fmt.routed_experts(c.indexer_topk)
        if self.params.return_kept_mass:
            meta["kept_mass_logprobs"] = [fmt.finite(x) for x in c.kept_mass_logprobs or []]
        if self.body.return_logprob and c.logprobs is not None:
            with_text = self.body.return_text_in_logprobs
            meta["output_token_logprobs"] = fmt.sglang_logprobs(
                self.tokenizer, c.token_ids, c.logprobs, with_text
            )
            if self.body.top_logprobs_num > 0:
                meta["output_top_logprobs"] = fmt.sglang_top_logprobs(
                    self.tokenizer, c.top_logprobs or [], self.body.top_logprobs_num, with_text
                )
        return meta

    def _routing(self, c: CompletionOutput) -> dict:
        start = self.body.routed_experts_start_len
        rows = None if c.routed_experts is None else c.routed_experts[start:]
        if not self.sglang:
            return {"routed_experts": fmt.routed_experts(rows)}
        blob = fmt.routed_experts(rows)
        return {
            "routed_experts": blob["data"] if blob else None,
            "routed_experts_shape": blob["shape"] if blob else None,
            "routed_experts_start_len": start,
        }
