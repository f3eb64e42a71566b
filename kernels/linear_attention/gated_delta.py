"""The gated delta rule (Gated DeltaNet's linear attention) in plain torch: the reference.

Per value head, a state S [Dk, Dv] carries the sequence. At each token t (g_t <= 0 a log decay,
beta_t in (0, 1) a write strength, q and k L2-normalised, q scaled by Dk^-0.5):

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - k_t^T S))^T      # the delta rule: write only what S mispredicts
    o_t = q_t^T S

`recurrent_gated_delta_rule` runs that token by token (decode: one token per sequence, batched).
`chunk_gated_delta_rule` runs a prefill chunk-wise: inside a chunk the writes solve one unit
lower-triangular system, so a chunk costs a few matmuls instead of C sequential steps. State is
float32 whatever the activations' dtype; heads may be grouped (Hv a multiple of Hk, value head h
reads key head h // (Hv // Hk)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the rsqrt, as Gated DeltaNet's kernels do


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, l2norm: bool):
    """float32 q, k with one head per value head, L2-normalised if asked, q scaled by Dk^-0.5."""
    groups = num_v_heads // q.shape[-2]
    q, k = q.float(), k.float()
    if groups > 1:
        q, k = (x.repeat_interleave(groups, dim=-2) for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, L, Hk, Dk]
    k: torch.Tensor,  # [B, L, Hk, Dk]
    v: torch.Tensor,  # [B, L, Hv, Dv]
    g: torch.Tensor,  # [B, L, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [B, L, Hv]
    state: torch.Tensor,  # [B, Hv, Dk, Dv] the state before the first token
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, L, Hv, Dv] in v's dtype, final [B, Hv, Dk, Dv])
    q, k = prepare_qk(q, k, v.shape[-2], l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (vf[:, t] - predicted) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out.to(v.dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [L, Hk, Dk] one sequence
    k: torch.Tensor,  # [L, Hk, Dk]
    v: torch.Tensor,  # [L, Hv, Dv]
    g: torch.Tensor,  # [L, Hv]
    beta: torch.Tensor,  # [L, Hv]
    state: torch.Tensor,  # [Hv, Dk, Dv] the state before the first token
    chunk_size: int = 64,
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([L, Hv, Dv] in v's dtype, final [Hv, Dk, Dv])
    length = v.shape[0]
    q, k = prepare_qk(q, k, v.shape[-2], l2norm)
    pad = -length % chunk_size
    # [H, N, C, D]: heads first, the sequence cut into N chunks of C (zero-padded: a padded
    # token has k = 0 and g = 0, so it neither writes nor decays the state)
    q, k, vf = (_chunks(F.pad(x, (0, 0, 0, 0, 0, pad)), chunk_size) for x in (q, k, v.float()))
    g, beta = (_chunks(F.pad(x.float(), (0, 0, 0, pad)), chunk_size) for x in (g, beta))
    gamma = g.cumsum(-1)  # [H, N, C] log decay from the chunk's start through each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # decay from token j to token i of a chunk, zero above the diagonal: [H, N, C, C]
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    kb = k * beta[..., None]
    # writes u solve (I + A) u = beta (v - exp(gamma) k S0), A strictly lower: A_ij = beta_i
    # decay_ij k_i.k_j (token i sees token j's write, decayed). Solve once for both terms.
    a = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk_size, device=v.device)
    rhs = torch.cat([vf * beta[..., None], kb * gamma.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u_v, u_s = solved.split([vf.shape[-1], k.shape[-1]], dim=-1)  # u = u_v - u_s @ S0
    attn = q @ k.transpose(-1, -2) * decay  # [H, N, C, C] within-chunk reads
    q_decayed = q * gamma.exp()[..., None]  # reads of the chunk's initial state
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes decayed to the chunk end
    s = state.float()
    out = torch.empty_like(vf)
    for n in range(vf.shape[1]):
        u = u_v[:, n] - u_s[:, n] @ s
        out[:, n] = q_decayed[:, n] @ s + attn[:, n] @ u
        s = s * gamma[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.flatten(1, 2)[:, :length].transpose(0, 1)
    return out.to(v.dtype), s


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, H, ...] -> [H, L // C, C, ...]"""
    x = x.movedim(0, 1)
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])
