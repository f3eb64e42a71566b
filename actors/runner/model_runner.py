"""One ModelRunner per tensor-parallel rank: owns the weights, the KV cache and the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.config import EngineConfig
from actors.engine.scheduler import SchedulerOutput
from actors.runner.inputs import InputPreparer, StepInputs
from actors.runner.kv_cache import KVCache
from actors.runner.sampler import Sampler
from kernels.attention import get_backend


@dataclass
class StepResult:
    """Per scheduled item, in the scheduler's order."""

    token_ids: list[int | None]  # None where the chunk did not reach the end of the sequence
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    prompt_logprobs: list[list[dict[int, float]]]  # new prompt-logprob entries per item


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: list[int]):
        self.config = config
        self.model = model
        self.device = device
        backend = get_backend(config.attention_backend, device)
        layers = model.attention_layers()
        for layer in layers:
            layer.backend = backend
        self.kv = KVCache.allocate(config, layers, model, dtype, device)
        self.inputs = InputPreparer(config.block_size, device, dtype)
        self.sampler = Sampler(hf_config.vocab_size, eos_token_ids, device, config.seed)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepResult:
        step = self.inputs.prepare(batch)
        hidden, routed = self.model(step.input_ids, step.positions, step.attn)
        if routed is not None:
            self.kv.store_routing(step.attn.slot_mapping, routed)
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        return self._sample(batch, step, logits)

    def _sample(self, batch: SchedulerOutput, step: StepInputs, logits: torch.Tensor) -> StepResult:
        items = batch.scheduled
        sample_rows = [first + count - 1 for item, (first, count) in zip(items, step.logits_rows)
                       if item.samples]
        seqs = [item.seq for item in items if item.samples]
        sampled = self.sampler(logits[sample_rows], seqs) if seqs else None
        n = len(items)
        result = StepResult([None] * n, [None] * n, [None] * n, [[] for _ in range(n)])
        k = 0
        for i, item in enumerate(items):
            if item.samples:
                result.token_ids[i] = sampled.token_ids[k]
                result.logprobs[i] = sampled.logprobs[k]
                result.top_logprobs[i] = sampled.top_logprobs[k]
                k += 1
        self._prompt_logprobs(items, step, logits, result)
        return result

    def _prompt_logprobs(self, items, step: StepInputs, logits: torch.Tensor,
                         result: StepResult) -> None:
        for i, item in enumerate(items):
            seq = item.seq
            if seq.params.prompt_logprobs is None:
                continue
            first, count = step.logits_rows[i]
            count -= int(item.samples)  # the sampling row is not a prompt row
            if count <= 0:
                continue
            lp = logits[first:first + count].float().log_softmax(dim=-1)  # [count, V]
            target0 = len(seq.prompt_logprobs)
            targets = torch.tensor(seq.token_ids[target0:target0 + count], device=lp.device)
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            top_v, top_i = lp.topk(seq.params.prompt_logprobs, dim=-1)  # k=0 gives empty rows
            for t, c, tv, ti in zip(targets.tolist(), chosen, top_v.tolist(), top_i.tolist()):
                entry = dict(zip(ti, tv))
                entry[t] = c
                result.prompt_logprobs[i].append(entry)

    def routed_experts(self, block_table: list[int], num_tokens: int):
        return self.kv.read_routing(block_table, num_tokens)

    def release(self, seq) -> None:
        self.sampler.release(seq)
