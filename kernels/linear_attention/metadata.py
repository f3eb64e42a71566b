"""Per-step metadata of linear-attention layers, built once per step and shared by layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StateMetadata:
    """Where each sequence's recurrent and conv state lives, in the attention layout.

    Sequences are prefill chunks first, then decodes (one token each), as in
    `AttentionMetadata`. Sequence i reads and writes the slot `state_slots[i]` of every
    linear-attention layer's state pools; a new sequence's slot is zeroed (or filled from a
    cached snapshot) before its first chunk runs.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    state_slots: torch.Tensor  # [B] int64
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int  # the longest sequence's new tokens (1 for a decode batch)
    # the host-side copies the prefill path plans with; None for a graph-replayed decode batch
    query_start_loc_host: list[int] | None = None
    state_slots_host: list[int] | None = None
    # speculative decoding: the rows that verify drafts (verify.py), or None
    verify: VerifyRows | None = None

    @property
    def num_seqs(self) -> int:
        return self.state_slots.shape[0]


@dataclass
class TokenInputs:
    """One layer's inputs of the step's verify tokens, in verify-token order."""

    x: torch.Tensor  # [Tv, C] the conv's input
    q: torch.Tensor  # [Tv, Hk, Dk] the delta rule's, after the conv
    k: torch.Tensor  # [Tv, Hk, Dk]
    v: torch.Tensor  # [Tv, Hv, Dv]
    g: torch.Tensor  # [Tv, Hv]
    beta: torch.Tensor  # [Tv, Hv]


@dataclass
class VerifyRows:
    """The step's verify rows: `seqs` are their indices in the step's sequence order (they
    sit among the prefill chunks), `lengths` their 1 + k tokens. Layers add their records."""

    seqs: list[int]
    lengths: list[int]
    records: dict[int, TokenInputs] = field(default_factory=dict)  # id(layer) -> inputs

    def token_rows(self, meta: StateMetadata) -> list[int]:
        """The step's token rows of every verify token, in verify-token order."""
        qsl = host_lists(meta)[0]
        return [qsl[i] + j for i, n in zip(self.seqs, self.lengths) for j in range(n)]

    def slots(self, meta: StateMetadata) -> list[int]:
        return [host_lists(meta)[1][i] for i in self.seqs]

    def record(self, layer, meta: StateMetadata, x, q, k, v, g, beta) -> None:
        """Keep `layer`'s inputs of the verify tokens (step rows [T, ...]) for `advance`."""
        idx = torch.tensor(self.token_rows(meta), device=x.device)
        parts = (t.index_select(0, idx) for t in (x, q, k, v, g, beta))
        self.records[id(layer)] = TokenInputs(*parts)

    def offsets(self) -> list[int]:
        """Each verify row's first token in verify-token order."""
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return out


def host_lists(meta: StateMetadata) -> tuple[list[int], list[int]]:
    """(query_start_loc, state_slots) on the host: prefills and verify rows plan with them."""
    if meta.query_start_loc_host is None or meta.state_slots_host is None:
        raise ValueError("linear-attention metadata with prefills needs its host-side lists")
    return meta.query_start_loc_host, meta.state_slots_host
