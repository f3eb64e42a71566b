"""A trainer's Gated DeltaNet layers on the engine's batch-invariant numerics
(kernels/linear_attention/invariant.py), in transformers' function signatures:
`raylane.batch_invariant()` installs them in place of the `causal_conv1d_fn` and
`torch_chunk_gated_delta_rule` the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next modeling files call.

transformers runs the delta rule as a chunked scan (a matmul-and-solve whose rounding follows
the chunking) and the conv as F.conv1d in the weights' dtype; the engine's mode runs the conv
tap by tap in float32 and the delta rule token by token. Here every token of a teacher-forced
batch goes through those same ops (`conv_taps`, `step`, exp and SiLU row by row), so each
sequence's outputs equal the engine's bit for bit. Plain torch ops: autograd flows through
(a Python loop over the tokens; the backward is not batch-invariant). On CUDA the delta rule
runs the engine's Triton kernel (triton_gdn.py), picked by the tensors' device; the conv's
elementwise ops serve both devices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.elementwise import rowwise, silu
from raylane.kernels.batch_invariant.grads import recomputed_grads
from raylane.kernels.linear_attention.conv1d import activate
from raylane.kernels.linear_attention.gated_delta import prepare_qk
from raylane.kernels.linear_attention.invariant import conv_taps, step


def causal_conv1d_fn(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """hidden_states [B, C, L], weight [C, W] -> [B, C, L]: the causal depthwise conv from zeros,
    its W taps summed oldest first in float32, then the activation, in hidden_states' dtype."""
    _packed(kwargs)
    window = F.pad(hidden_states.float(), (weight.shape[1] - 1, 0))  # [B, C, W - 1 + L]
    y = conv_taps(window, weight.float())
    if bias is not None:
        y = y + bias.float()[:, None]
    if activation in ("silu", "swish"):  # each token's [C] row on the vector path
        y = silu(y.transpose(1, 2)).transpose(1, 2)
    else:
        y = activate(y, activation)  # None (or a ValueError)
    return y.to(hidden_states.dtype)


def chunk_gated_delta_rule(
    query: torch.Tensor,  # [B, L, Hk, Dk]
    key: torch.Tensor,  # [B, L, Hk, Dk]
    value: torch.Tensor,  # [B, L, Hv, Dv]
    g: torch.Tensor,  # [B, L, Hv] log decay
    beta: torch.Tensor,  # [B, L, Hv]
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,  # [B, Hv, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([B, L, Hv, Dv] in query's dtype, final state)
    """The gated delta rule token by token, every sequence of the batch at once (`chunk_size`
    is accepted for the signature: nothing is chunked). CUDA tensors run the engine's Triton
    kernel (triton_gdn.py), its backward recomputed in the torch ops below."""
    _packed(kwargs)
    if on_triton(value.device):
        core, s = _TritonDeltaRule.apply(
            query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel
        )
    else:
        core, s = _stepped(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return core.to(query.dtype), s if output_final_state else None


def _stepped(query, key, value, g, beta, initial_state, l2norm: bool):
    """The rule in torch ops, token by token: ([B, L, Hv, Dv] float32, final state)."""
    batch, length, heads, _ = value.shape
    q, k = prepare_qk(query, key, heads, l2norm)
    decay = rowwise(torch.exp, g.float().reshape(-1, heads)).reshape(batch, length, heads)
    v, b = value.float(), beta.float()
    if initial_state is None:
        s = q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    else:
        s = initial_state.float()
    outs = []
    for t in range(length):
        out, s = step(s, q[:, t], k[:, t], v[:, t], decay[:, t], b[:, t])
        outs.append(out)
    return (torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)), s


class _TritonDeltaRule(torch.autograd.Function):
    """triton_gdn's recurrence over each padded row as one sequence; the backward
    differentiates `_stepped` (the same math in torch ops: not batch-invariant)."""

    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, l2norm):
        from raylane.kernels.batch_invariant.triton_gdn import recurrent_delta_rule

        ctx.save_for_backward(query, key, value, g, beta, initial_state)
        ctx.l2norm = l2norm
        batch, length, heads, dv = value.shape
        if initial_state is None:
            state = value.new_zeros(batch, heads, key.shape[-1], dv, dtype=torch.float32)
        else:
            state = initial_state.float().contiguous().clone()
        starts = torch.arange(batch + 1, device=value.device) * length
        flat = [x.flatten(0, 1) for x in (query, key, value, g, beta)]  # [B * L, ...]
        slots = torch.arange(batch, device=value.device)
        out = recurrent_delta_rule(*flat, state, starts, slots, l2norm)
        return out.view(value.shape), state

    @staticmethod
    def backward(ctx, grad_core, grad_state):
        def rule(*inputs):
            return _stepped(*inputs, ctx.l2norm)

        return (*recomputed_grads(rule, ctx.saved_tensors, [grad_core, grad_state]), None)


def _packed(kwargs: dict[str, Any]) -> None:
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
        raise ValueError(
            "raylane.batch_invariant: packed sequences (cu_seqlens) are not covered in Gated "
            "DeltaNet layers; pad the batch on the right with an attention mask"
        )
