"""Speculative decoding on linear-attention layers: a verify row's rejected drafts must leave
no trace in its sequence's conv and recurrent state.

A verify row feeds 1 + k tokens (the last sampled token, then k drafts). Its paged K/V rows of
rejected drafts are simply written over later; a recurrent state cannot drop a token it took
in. So a layer runs the verify rows' delta rule token by token with the backend's decode
step, on a copy of their recurrent states (each output is what a decode step at that position
gives), leaves their slots (conv and recurrent) as they were before the step, and records
each token's inputs (`record`).
Once the sampler has said how many drafts were accepted (`a`, the same on every rank),
`advance` replays the first a + 1 tokens into the slots: the state after exactly the accepted
tokens. The cost: the recurrence of the verify tokens runs twice (once for the outputs, once
for the a + 1 accepted), small against the projections; the records hold each verify token's
conv input and q / k / v / g / beta per layer (no per-position state copies), and the copy of
the states lives for one layer's call.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from raylane.kernels.linear_attention.metadata import StateMetadata, TokenInputs, host_lists


def decode_meta(slots: list[int], device) -> StateMetadata:
    """Metadata of a one-token-per-sequence step over `slots`."""
    n = len(slots)
    return StateMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.long, device=device),
        num_prefills=0,
        num_prefill_tokens=0,
        max_query_len=1,
        query_start_loc_host=list(range(n + 1)),
        state_slots_host=list(slots),
    )


def without_verify(meta: StateMetadata) -> tuple[StateMetadata, list[int]]:
    """The step's metadata without its verify rows, and the token rows it keeps."""
    assert meta.verify is not None
    qsl, slots = host_lists(meta)
    drop = set(meta.verify.seqs)
    keep = [i for i in range(len(slots)) if i not in drop]
    rows = [t for i in keep for t in range(qsl[i], qsl[i + 1])]
    new_qsl = [0]
    for i in keep:
        new_qsl.append(new_qsl[-1] + qsl[i + 1] - qsl[i])
    num_prefills = sum(1 for i in keep if i < meta.num_prefills)
    device = meta.state_slots.device
    sub = replace(
        meta,
        query_start_loc=torch.tensor(new_qsl, dtype=torch.int32, device=device),
        state_slots=torch.tensor([slots[i] for i in keep], dtype=torch.long, device=device),
        num_prefills=num_prefills,
        num_prefill_tokens=new_qsl[num_prefills],
        max_query_len=max((new_qsl[i + 1] - new_qsl[i] for i in range(len(keep))), default=1),
        query_start_loc_host=new_qsl,
        state_slots_host=[slots[i] for i in keep],
        verify=None,
    )
    return sub, rows


def verify_conv(backend, x, weight, conv_state, meta: StateMetadata, activation) -> torch.Tensor:
    """The causal conv of a step with verify rows ([T, C] -> [T, C]); their slots keep the
    state from before the step."""
    assert meta.verify is not None
    at = torch.tensor(meta.verify.slots(meta), dtype=torch.long, device=conv_state.device)
    saved = conv_state[at]  # a copy (advanced indexing)
    out = backend.conv(x, weight, None, conv_state, meta, activation)
    conv_state[at] = saved
    return out


def verify_delta_rule(backend, q, k, v, g, beta, state, meta: StateMetadata) -> torch.Tensor:
    """The delta rule of a step with verify rows ([T, ...] -> [T, Hv, Dv]): the other rows as
    usual; the verify rows token by token on a copy of their states (their slots untouched)."""
    verify = meta.verify
    assert verify is not None
    out = v.new_empty(v.shape)
    sub, rows = without_verify(meta)
    if rows:
        idx = torch.tensor(rows, device=v.device)
        parts = (x.index_select(0, idx) for x in (q, k, v, g, beta))
        out[idx] = backend.delta_rule(*parts, state, sub)
    copies = state[torch.tensor(verify.slots(meta), device=state.device)]  # [R, Hv, Dk, Dv]
    starts = [host_lists(meta)[0][i] for i in verify.seqs]
    for j in range(max(verify.lengths)):
        live = [r for r, n in enumerate(verify.lengths) if n > j]
        idx = torch.tensor([starts[r] + j for r in live], device=v.device)
        parts = (x.index_select(0, idx) for x in (q, k, v, g, beta))
        out[idx] = backend.delta_rule(*parts, copies, decode_meta(live, state.device))
    return out


def advance(
    layers: list, records: dict[int, TokenInputs], slots: list[int], counts: list[int],
    offsets: list[int], after_first=None,
) -> None:  # fmt: skip
    """Feed each verify row's first `counts[r]` tokens into its slot (conv and recurrent
    state) of every layer, token by token; `after_first()` runs once every row has taken its
    first token (a decode-row snapshot of the state there)."""
    for j in range(max(counts, default=0)):
        live = [r for r, n in enumerate(counts) if n > j]
        for layer in layers:
            _step(
                layer, records[id(layer)], [slots[r] for r in live], [offsets[r] + j for r in live]
            )
        if j == 0 and after_first is not None:
            after_first()


def _step(layer, inputs: TokenInputs, slots: list[int], tokens: list[int]) -> None:
    conv, state = layer.conv_state, layer.recurrent_state
    idx = torch.tensor(tokens, device=inputs.x.device)
    at = torch.tensor(slots, dtype=torch.long, device=conv.device)
    x = inputs.x.index_select(0, idx)  # [R, C]
    window = torch.cat([conv[at], x[:, :, None].to(conv.dtype)], dim=2)
    conv[at] = window[:, :, 1:]
    parts = (t.index_select(0, idx) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
    layer.backend.delta_rule(*parts, state, decode_meta(slots, state.device))
