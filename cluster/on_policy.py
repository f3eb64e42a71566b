"""The trainer's half of bitwise on-policy RL: `batch_invariant()`, a context manager a trainer
wraps around its own, unmodified transformers model.

    from raylane import batch_invariant

    with batch_invariant():
        logits = model(input_ids, attention_mask=mask).logits      # right padding
        lp = torch.log_softmax(logits.float(), -1)                  # gather the sampled tokens
    # or: lp = batch_invariant.logprobs(model, input_ids, mask)     # [B, T - 1]

Inside it, the torch ops transformers' models call run on the kernels of the engine's
batch-invariant mode (`EngineConfig(batch_invariant=True)`): `F.linear` over rows padded to a
multiple of 16, SiLU, GELU, softplus and sigmoid row by row on the vector path, attention
("sdpa" and "eager" alike; sliding windows and gpt-oss's sinks included) through the C paged
kernel, MoE experts (whatever `experts_implementation`; gpt-oss's biased, interleaved layout
too) one expert at a time, as transformers' "eager" loop and the engine's mode both do; the
Gated DeltaNet layers of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (their modeling files'
`causal_conv1d_fn` and `torch_chunk_gated_delta_rule`) on the engine's token-by-token
recurrence; DSA attention (DeepSeek-V3.2, GLM-5: the attention class's `forward`) on the
engine's per-token indexer and absorbed sparse attention; DeepSeek-V2's complex-number RoPE
rotated as the engine (and DeepSeek-V3) rotates. So the teacher-forced logprobs of a rollout
equal, bit for bit, the logprobs the engine returned for it, at any trainer batch size.
Autograd works (attention's backward recomputes in torch ops). Leaving the context restores
every op. On the CPU, at TP = 1, for Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3,
DeepSeek-V3.2, GLM-5, Gemma 3, gpt-oss and the Qwen3.5 / Qwen3-Next hybrids in float32 and
bfloat16 (docs/rl.md says what is covered and what is not; not a TP = 2 rollout against a
TP = 1 trainer: the all-reduce sums the ranks' partial sums, an order one rank lacks).

On CUDA the same swaps take the engine's CUDA kernels (kernels/batch_invariant/backend.py's
`on_triton`): F.linear the fixed-tile Triton matmul, the RMSNorm modules (Llama-style, (1 + w),
gated) and the float32 log_softmax the row-wise Triton kernels, attention (MLA's expanded form
too) each row a one-split Triton decode, the experts triton_experts.py's kernel, DSA and the
Gated DeltaNet rule their Triton forms (kernels/batch_invariant/trainer_cuda.py,
triton_gdn_norms.py; gpt-oss's RMSNorm with its weight applied before the cast back, as
transformers and the engine apply it). Checked under Triton's interpreter only, never on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from raylane.kernels.batch_invariant import complex_rope, gated_delta_net, padded_linear
from raylane.kernels.batch_invariant.attention import invariant_attention
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.dsa import dsa_attention_forward
from raylane.kernels.batch_invariant.elementwise import gelu as invariant_gelu
from raylane.kernels.batch_invariant.elementwise import sigmoid as invariant_sigmoid
from raylane.kernels.batch_invariant.elementwise import silu as invariant_silu
from raylane.kernels.batch_invariant.elementwise import softplus as invariant_softplus
from raylane.kernels.batch_invariant.trainer_cuda import log_softmax_swaps, modeling, norm_swaps
from raylane.kernels.batch_invariant.triton_gdn_norms import (
    GATED_NORMS,
    OFFSET_NORMS,
    gated_norm,
    offset_norm,
)

_LOCK = threading.Lock()  # the ops are process-wide: one context swaps them at a time
_ATTENTION_KEYS = ("sdpa", "eager")
# transformers' modeling files whose Gated DeltaNet layers call these module-level functions
_LINEAR_ATTENTION_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
_LINEAR_ATTENTION_FUNCTIONS: dict[str, Callable] = {
    "causal_conv1d_fn": gated_delta_net.causal_conv1d_fn,
    "torch_chunk_gated_delta_rule": gated_delta_net.chunk_gated_delta_rule,
}
# transformers' DSA attention classes, whose forward runs the engine's sparse attention inside
_DSA_CLASSES = {"deepseek_v32": "DeepseekV32Attention", "glm_moe_dsa": "GlmMoeDsaAttention"}


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Run transformers models on the engine's batch-invariant kernels until the block ends
    (not re-entrant from another thread: the ops are process-wide)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("raylane.batch_invariant() is already active in this process")
    tables = [
        (ALL_ATTENTION_FUNCTIONS._local_mapping, _ATTENTION_KEYS, invariant_attention),
        (ALL_EXPERTS_FUNCTIONS._local_mapping, list(ALL_EXPERTS_FUNCTIONS), invariant_experts),
    ]
    saved = [(local, {key: local.get(key) for key in keys}) for local, keys, _ in tables]
    swaps = _attribute_swaps()
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    try:
        for owner, name, fn in swaps:  # the same calls, some with more (optional) parameters
            setattr(owner, name, fn)
        for local, keys, fn in tables:
            local.update(dict.fromkeys(keys, fn))
        yield
    finally:
        for owner, name, fn in before:
            setattr(owner, name, fn)
        for local, entries in saved:
            for key, fn in entries.items():
                if fn is None:
                    local.pop(key, None)
                else:
                    local[key] = fn
        _LOCK.release()


def _attribute_swaps() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement): the torch ops, and the Gated DeltaNet functions of
    each hybrid modeling file this transformers has."""
    swaps: list[tuple[Any, str, Any]] = [
        (F, "linear", padded_linear),
        (F, "silu", invariant_silu),
        (F, "gelu", invariant_gelu),
        (F, "softplus", invariant_softplus),
        (torch, "sigmoid", invariant_sigmoid),
        (torch.Tensor, "sigmoid", invariant_sigmoid),
    ]
    for family in _LINEAR_ATTENTION_MODULES:
        if (module := modeling(family)) is not None:
            swaps += [(module, name, fn) for name, fn in _LINEAR_ATTENTION_FUNCTIONS.items()]
    for family, cls in _DSA_CLASSES.items():
        if (module := modeling(family)) is not None:
            swaps.append((getattr(module, cls), "forward", dsa_attention_forward))
    if (v2 := modeling("deepseek_v2")) is not None:  # its complex RoPE, rotated as V3's
        swaps.append((v2.DeepseekV2RotaryEmbedding, "forward", complex_rope.rotary_forward))
        swaps.append((v2, "apply_rotary_emb", complex_rope.apply_rotary_emb))
    return swaps + norm_swaps() + _offset_and_gated_norms() + log_softmax_swaps()


def _offset_and_gated_norms() -> list[tuple[Any, str, Any]]:
    """The (1 + w) norms (Gemma 3, the hybrids) and the hybrids' gated norms: the engine's
    Triton forms on CUDA (triton_gdn_norms.py), torch's own on the CPU."""
    swaps = []
    for table, wrap in ((OFFSET_NORMS, offset_norm), (GATED_NORMS, gated_norm)):
        for family, name in table.items():
            if (module := modeling(family)) is not None:
                cls = getattr(module, name)
                swaps.append((cls, "forward", wrap(cls.forward)))
    return swaps


def invariant_experts(
    module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function signature, one expert at a time in ascending order, each
    over its tokens slot by slot (`F.linear` is the padded one here), the contributions added
    in that order in the hidden dtype: the engine's mode does the same (kernels/moe.py).
    gpt-oss's layout (transposed, gate and up interleaved, biases) runs as the engine lays it
    out: [gate | up] rows, the bias added after the matmul, re-interleaved for the gate."""
    m: Any = module
    if not m.has_gate:
        raise ValueError(
            f"raylane.batch_invariant: {type(module).__name__}'s ungated experts are not covered"
        )
    out = torch.zeros_like(hidden)  # [T, H]
    for expert in range(m.gate_up_proj.shape[0]):
        slot, token = torch.where(top_k_index.t() == expert)  # slot-major, as transformers
        if token.numel() == 0:
            continue
        gate_up, down = _expert_weights(m, expert)
        h = _expert_linear(hidden[token], gate_up)  # [S, 2I], gate columns then up columns
        if m.has_bias:
            h = h + _concatenated(m.gate_up_proj_bias[expert], m.is_concatenated)
        if not m.is_concatenated:  # back to the interleaved columns the model's gate reads
            h = torch.stack(h.chunk(2, dim=-1), dim=-1).flatten(-2)
        h = _expert_linear(m._apply_gate(h), down)
        if m.has_bias:
            h = h + m.down_proj_bias[expert]
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out


def _expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [S, in] @ weight [out, in].T as the engine's mode runs its experts: the padded linear
    on the CPU, triton_experts.py's kernel (one row at a time, no tl.dot) on CUDA."""
    if on_triton(x.device):
        from raylane.kernels.batch_invariant.triton_experts import ExpertLinear

        return ExpertLinear.apply(x, weight)
    return F.linear(x, weight)


def _expert_weights(m: Any, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's (gate_up [2I, H] with gate rows then up rows, down [H, I]), laid out as the
    engine keeps them (contiguous: a GEMM's order may follow the weight's strides)."""
    gate_up, down = m.gate_up_proj[expert], m.down_proj[expert]
    if m.is_transposed:  # [H, 2I], [I, H]
        gate_up, down = gate_up.t(), down.t()
    if not m.is_concatenated:
        gate_up = torch.cat([gate_up[0::2], gate_up[1::2]])
    return gate_up.contiguous(), down.contiguous()


def _concatenated(x: torch.Tensor, is_concatenated: bool) -> torch.Tensor:
    """x [2I], gate and up interleaved unless `is_concatenated` -> [2I] as [gate | up]."""
    return x if is_concatenated else torch.cat([x[0::2], x[1::2]])


def logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Each next token's logprob under `model`, inside `batch_invariant()`: input_ids [B, T]
    (right padded; `attention_mask` [B, T], 1 for real tokens) -> [B, T - 1] float32, entry
    (b, t) the logprob of input_ids[b, t + 1]. Padded entries are 0."""
    with batch_invariant():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1)  # on CUDA: the sampler's kernel
    taken = lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if attention_mask is not None:
        taken = taken * attention_mask[:, 1:].to(taken.dtype)
    return taken


batch_invariant.logprobs = logprobs  # type: ignore[attr-defined]
