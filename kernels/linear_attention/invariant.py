"""The batch-invariant mode's linear attention: every token of every sequence through one
formulation, so a sequence's outputs and states are the same bit for bit whatever shares its
step, however its prefill is split, and whether a token runs in a prefill chunk, a decode
batch, a verify row or a recompute after preemption.

The reference backend differs in each of those: its chunked delta rule cuts a prefill into
chunks from the chunk's first token (a matmul-and-solve whose rounding follows the split) while
decode steps token by token; its prefill conv is F.conv1d over the chunk, its decode conv a sum
over the taps; and transcendental ops (exp, SiLU) round otherwise on torch's vector path than
on its scalar tail, where a row lands following the step's token count. Here:
- the conv sums its W taps one by one in float32 (elementwise mul and add, rounded per element);
- the delta rule steps token by token for prefills too, each step elementwise ops and sums over
  Dk only (`step`);
- exp and SiLU run `rowwise` (every row on the vector path).
On CUDA the conv's elementwise ops already round alike wherever a row sits; the recurrence's
sums over Dk would not (torch's reductions size their blocks by the row count), so it runs a
Triton kernel there, triton_gdn.py: the same steps, each sum in one tile the layer fixes.
What it costs (2 CPU cores, one layer of 32 value heads, Dk = Dv = 128): a 256-token prefill
50 ms token by token against 52 ms chunked; a decode batch of 8, 18 ms against 16 ms.
"""

from __future__ import annotations

import torch
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.elementwise import rowwise, silu
from raylane.kernels.linear_attention.conv1d import activate
from raylane.kernels.linear_attention.gated_delta import prepare_qk
from raylane.kernels.linear_attention.metadata import StateMetadata, host_lists


def conv_taps(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [..., C, W - 1 + L] float32, weight [C, W] float32 -> [..., C, L]: each output the
    taps summed in one order, oldest first, whatever L and the leading dims."""
    width = weight.shape[1]
    length = window.shape[-1] - width + 1
    acc = window[..., 0:length] * weight[:, 0:1]
    for i in range(1, width):
        acc = acc + window[..., i : i + length] * weight[:, i : i + 1]
    return acc


def step(
    s: torch.Tensor,  # [B, Hv, Dk, Dv] float32, the state before the token
    q: torch.Tensor,  # [B, Hv, Dk] float32, prepared (prepare_qk)
    k: torch.Tensor,  # [B, Hv, Dk]
    v: torch.Tensor,  # [B, Hv, Dv] float32
    decay: torch.Tensor,  # [B, Hv] exp(g)
    beta: torch.Tensor,  # [B, Hv] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, Hv, Dv], the state after the token)
    """One token of the gated delta rule; products elementwise, each sum over Dk of one row
    (no matmul: a batched GEMM's order may follow the batch)."""
    s = s * decay[..., None, None]
    predicted = (k[..., None] * s).sum(-2)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (q[..., None] * s).sum(-2), s


class InvariantLinearAttention:
    name = "batch_invariant"

    def conv(self, x, weight, bias, conv_state, meta: StateMetadata, activation="silu"):
        """[T, C] -> [T, C]: causal conv1d of every sequence, its conv state carried."""
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        wf, split, keep = weight.float(), meta.num_prefill_tokens, conv_state.shape[2]
        if meta.num_prefills:
            qsl, slots = host_lists(meta)
            for i in range(meta.num_prefills):
                rows, slot = slice(qsl[i], qsl[i + 1]), slots[i]
                window = torch.cat([conv_state[slot].float(), x[rows].T.float()], dim=1)
                y[rows] = conv_taps(window, wf).T
                conv_state[slot] = window[:, window.shape[1] - keep :].to(conv_state.dtype)
        if split < x.shape[0]:
            at = meta.state_slots[meta.num_prefills :]
            window = torch.cat([conv_state[at].float(), x[split:, :, None].float()], dim=2)
            y[split:] = conv_taps(window, wf)[..., 0]
            conv_state[at] = window[:, :, 1:].to(conv_state.dtype)
        if bias is not None:
            y = y + bias.float()
        if activation in ("silu", "swish"):
            return silu(y).to(x.dtype)
        return activate(y, activation).to(x.dtype)  # None (or a ValueError)

    def delta_rule(self, q, k, v, g, beta, state, meta: StateMetadata, l2norm: bool = True):
        """[T, H, D] -> [T, Hv, Dv]: token by token for prefills and decodes alike (on CUDA in
        one Triton kernel, triton_gdn.py, with no host sync)."""
        if on_triton(v.device):
            from raylane.kernels.batch_invariant.triton_gdn import recurrent_delta_rule

            at, starts = meta.state_slots, meta.query_start_loc
            return recurrent_delta_rule(q, k, v, g, beta, state, starts, at, l2norm).to(v.dtype)
        q, k = prepare_qk(q, k, v.shape[-2], l2norm)
        args = (q, k, v.float(), rowwise(torch.exp, g.float()), beta.float())
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        split = meta.num_prefill_tokens
        if meta.num_prefills:
            qsl, slots = host_lists(meta)
            for i in range(meta.num_prefills):
                s = state[slots[i]][None]  # [1, Hv, Dk, Dv]
                for t in range(qsl[i], qsl[i + 1]):
                    out[t : t + 1], s = step(s, *(a[t : t + 1] for a in args))
                state[slots[i]] = s[0]
        if split < v.shape[0]:
            at = meta.state_slots[meta.num_prefills :]
            out[split:], state[at] = step(state[at], *(a[split:] for a in args))
        return out.to(v.dtype)
