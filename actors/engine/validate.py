"""Checks a request before it reaches the scheduler: each failure is a ValueError naming a field."""

from __future__ import annotations

from raylane.actors.engine.sampling_params import SamplingParams


class RequestValidator:
    def __init__(self, parts):
        self.tokenizer = parts.tokenizer
        self.config = parts.config
        self.blocks = parts.block_manager
        self.vocab_size = parts.vocab_size
        self.num_moe_layers = parts.num_moe_layers
        self.num_dsa_layers = parts.runner_info.num_dsa_layers
        self.grammars = parts.grammars

    def check(self, prompt, params: SamplingParams) -> list[int]:
        """Validate and return the prompt's token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._token_ids(prompt)
        self._check_length(ids, params)
        self._check_features(params)
        return ids

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(
                    f"prompt: token ids must be ints in [0, {self.vocab_size}); got {bad[:5]}"
                )
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len={max_len}; shorten the prompt"
            )
        total = min(len(ids) + (params.max_tokens or max_len), max_len)
        blocks = self.blocks.groups.blocks_to_hold(total, self.config.max_num_batched_tokens)
        if blocks > self.config.num_kv_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens = {total} tokens need {blocks} KV "
                f"blocks but the cache has {self.config.num_kv_blocks}; lower "
                f"max_tokens or raise num_kv_blocks"
            )

    def _check_features(self, params: SamplingParams) -> None:
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}: {value} is more than max_logprobs={limit}")
        if params.return_routed_experts:
            if not self.num_moe_layers:
                raise ValueError("return_routed_experts: the model has no MoE layers")
            if not self.config.enable_return_routed_experts:
                raise ValueError(
                    "return_routed_experts: start the engine with "
                    "EngineConfig(enable_return_routed_experts=True)"
                )
        if params.return_indexer_topk:
            if not self.num_dsa_layers:
                raise ValueError("return_indexer_topk: the model has no sparse-attention layers")
            if not self.config.enable_return_indexer_topk:
                raise ValueError(
                    "return_indexer_topk: start the engine with "
                    "EngineConfig(enable_return_indexer_topk=True)"
                )
        if params.structured_outputs is not None:
            self.grammars.grammar(params.structured_outputs)  # compiles once; ValueError if bad

    def render_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}]: needs a 'role'")
        template_kwargs.setdefault("add_generation_prompt", True)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **template_kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def as_prompt_list(prompts) -> list[str | list[int]]:
    """`generate`'s prompts as a list: one string, one list of ids, or a list of those."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt of token ids
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return prompts


def as_params_list(params, count: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt (one given, or None, serves them all)."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(f"params: got {len(params)} SamplingParams for {count} prompts")
    return list(params)
