"""The trainer's half of bitwise on-policy RL: `batch_invariant()`, a context manager a trainer
wraps around its own, unmodified transformers model.

    from raylane import batch_invariant

    with batch_invariant():
        logits = model(input_ids, attention_mask=mask).logits      # right padding
        lp = torch.log_softmax(logits.float(), -1)                  # gather the sampled tokens
    # or: lp = batch_invariant.logprobs(model, input_ids, mask)     # [B, T - 1]

Inside it, the torch ops transformers' models call run on the kernels of the engine's
batch-invariant mode (`EngineConfig(batch_invariant=True)`): `F.linear` over rows padded to a
multiple of 16, SiLU, GELU and sigmoid row by row on the vector path, attention ("sdpa" and "eager"
alike) through the C paged kernel, and MoE experts (whatever `experts_implementation`) one
expert at a time, as transformers' "eager" loop and the engine's mode both do. So the
teacher-forced logprobs of a rollout equal, bit for bit, the logprobs the engine returned for
it, at any trainer batch size. Autograd works (attention's backward recomputes in torch ops).
Leaving the context restores every op. On the CPU, at TP = 1, for Llama, Qwen2, Qwen3,
Qwen3-MoE and DeepSeek-V3 in float32 and bfloat16 (docs/rl.md says what is covered and what
is not).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from raylane.kernels.batch_invariant import padded_linear
from raylane.kernels.batch_invariant.attention import invariant_attention
from raylane.kernels.batch_invariant.elementwise import gelu as invariant_gelu
from raylane.kernels.batch_invariant.elementwise import sigmoid as invariant_sigmoid
from raylane.kernels.batch_invariant.elementwise import silu as invariant_silu

_LOCK = threading.Lock()  # the ops are process-wide: one context swaps them at a time
_ATTENTION_KEYS = ("sdpa", "eager")


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run transformers models on the engine's batch-invariant kernels until the block ends
    (not re-entrant from another thread: the ops are process-wide)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("raylane.batch_invariant() is already active in this process")
    swaps = [
        (ALL_ATTENTION_FUNCTIONS._local_mapping, _ATTENTION_KEYS, invariant_attention),
        (ALL_EXPERTS_FUNCTIONS._local_mapping, list(ALL_EXPERTS_FUNCTIONS), invariant_experts),
    ]
    saved = [(local, {key: local.get(key) for key in keys}) for local, keys, _ in swaps]
    linear, silu, gelu = F.linear, F.silu, F.gelu
    sigmoids = torch.sigmoid, torch.Tensor.sigmoid
    try:
        # the same calls with more (optional) parameters
        F.linear, F.silu = padded_linear, invariant_silu  # type: ignore[assignment]
        F.gelu = invariant_gelu  # type: ignore[assignment]
        torch.sigmoid = torch.Tensor.sigmoid = invariant_sigmoid  # type: ignore[assignment]
        for local, keys, fn in swaps:
            local.update(dict.fromkeys(keys, fn))
        yield
    finally:
        F.linear, F.silu, F.gelu = linear, silu, gelu
        torch.sigmoid, torch.Tensor.sigmoid = sigmoids  # type: ignore[method-assign]
        for local, before in saved:
            for key, fn in before.items():
                if fn is None:
                    local.pop(key, None)
                else:
                    local[key] = fn
        _LOCK.release()


def invariant_experts(
    module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function signature, one expert at a time in ascending order, each
    over its tokens slot by slot (`F.linear` is the padded one here), the contributions added
    in that order in the hidden dtype: the engine's mode does the same (kernels/moe.py)."""
    m: Any = module
    if m.is_transposed or m.has_bias or not m.is_concatenated or not m.has_gate:
        raise ValueError(
            f"raylane.batch_invariant: {type(module).__name__}'s expert layout (transposed, "
            "biased or interleaved weights) is not covered"
        )
    out = torch.zeros_like(hidden)  # [T, H]
    for expert in range(m.gate_up_proj.shape[0]):
        slot, token = torch.where(top_k_index.t() == expert)  # slot-major, as transformers
        if token.numel() == 0:
            continue
        h = m._apply_gate(F.linear(hidden[token], m.gate_up_proj[expert]))
        h = F.linear(h, m.down_proj[expert]) * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Each next token's logprob under `model`, inside `batch_invariant()`: input_ids [B, T]
    (right padded; `attention_mask` [B, T], 1 for real tokens) -> [B, T - 1] float32, entry
    (b, t) the logprob of input_ids[b, t + 1]. Padded entries are 0."""
    with batch_invariant():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    taken = lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if attention_mask is not None:
        taken = taken * attention_mask[:, 1:].to(taken.dtype)
    return taken


batch_invariant.logprobs = logprobs  # type: ignore[attr-defined]
