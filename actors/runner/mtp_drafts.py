"""MTP drafts on the runner: after a step's forward and sampling, the model's MTP layer runs
over the same rows and proposes each sampling sequence's next draft.

MTP row p takes the main model's hidden state at p and the embedding of token p + 1, and
writes its own latent cache row at p's slot (the MTP layer's attention layer has a cache of
its own, after the main layers'), so it shares the target's block tables: nothing else is
allocated. Every step runs it (prefill chunks, decodes, verify rows), so its cache holds a
row for every computed position; a rejected draft's row is written over later, like the
main layers' rows.

Token p + 1 of row p is the next input token of the chunk; for a chunk's last row it is the
next prompt token (a chunk that does not sample) or the token just sampled; a verify row
with `a` accepted drafts takes the sampled token at its row a (rows after it hold rejected
drafts: garbage that later steps overwrite, and that rows up to a cannot see). The draft for
the next step is drawn from the MTP logits at that row (argmax for greedy requests; a draw
from q for sampled ones, draft_sampling.py); where min(1, p/q) verifies it, q stays on the
request (`draft_proposal`) until the step that verifies it (`attach_draft_probs`).

Chained steps (`num_drafts` > 1, vLLM's and SGLang's way with DeepSeek-V3's one MTP layer):
draft j + 1 comes from one more MTP step, a decode row at the position after draft j's
predecessor, taking draft j's embedding and the previous MTP step's output hidden state
(normed, as Hugging Face's MtpModel chains its layers) in place of the main model's, which
does not exist yet. Step j runs MTP layer min(j, layers - 1): the last layer is reused when
the checkpoint has fewer layers than drafts (Qwen3.5's and Qwen3-Next's one `mtp` module: its
block 0 every step). An MTP layer's block is full attention (MLA, or Qwen's gated attention):
a chained step's metadata carries no linear-attention state (`attn.linear` None), so on
hybrid models it reads and writes only the MTP layer's paged rows, never a sequence's
recurrent state. A chained step's cache rows sit at positions the next step computes (the
engine reserved their slots, `Drafter`); the next step's MTP pass writes them over with the
main model's hidden states before any row reads them. A row whose block table does not
cover the position (no slot reserved: the pool was full) stops its chain there.
"""

from __future__ import annotations

import torch
from raylane.actors.runner.draft_sampling import draft_words, draw_drafts, verified_by_ratio
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.requests import ScheduledRequest
from raylane.kernels.attention.builder import SeqSlice, build_metadata


def mtp_drafts(
    model,
    scheduled: list[ScheduledRequest],
    step: StepInputs,
    hidden: torch.Tensor,
    sampler,
    num_drafts: int = 1,
) -> list[tuple[int, ...] | None]:
    """Run MTP layer 0 over the step's rows (hidden [T, H] of the main forward), then up to
    num_drafts - 1 chained steps; per entry, the drafts for the tokens after its newest one
    (None where it sampled nothing)."""
    ids, rows = _next_tokens(scheduled, step)
    out, _ = model.mtp_forward(0, ids, step.positions, hidden, step.attn)
    picked = [i for i, r in enumerate(rows) if r is not None]
    if not picked:
        return [None] * len(rows)
    index = torch.tensor([rows[i] for i in picked], device=out.device)
    chains = [Chain(scheduled[i], p + 1) for i, p in zip(picked, step.positions[index].tolist())]
    _extend(model, chains, out.index_select(0, index), sampler)
    for j in range(1, num_drafts):
        live = [c for c in chains if c.has_slot(j, step.attn.block_size)]
        if not live:
            break
        _chain_step(model, live, j, step.attn.block_size, sampler)
    drafts: list[tuple[int, ...] | None] = [None] * len(rows)
    for i, chain in zip(picked, chains):
        drafts[i] = tuple(chain.tokens)
        chain.keep_q()
    return drafts


class Chain:
    """One sampling entry's drafts so far: tokens, their q (where min(1, p/q) verifies
    them), and the last MTP step's output hidden state [H]."""

    def __init__(self, item: ScheduledRequest, newest: int):
        self.item, self.newest = item, newest  # newest: its newest token's position
        self.tokens: list[int] = []
        self.qs: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None

    def has_slot(self, j: int, block_size: int) -> bool:
        """Chained step j's row (at position newest + j - 1) has a reserved KV slot."""
        return (self.newest + j - 1) // block_size < len(self.item.state.block_ids)

    @property
    def first_position(self) -> int:
        """The output position of its first draft: after this step's token and accepted
        drafts (the step's tokens are not in the request's state yet)."""
        return self.item.state.num_output_tokens + self.item.num_accepted + 1

    def keep_q(self) -> None:
        """Where min(1, p/q) verifies its drafts, their q [drafts, V] stay on the request
        for the step that verifies them (`attach_draft_probs`)."""
        proposal = None
        if self.qs:
            proposal = (self.first_position, tuple(self.tokens), torch.stack(self.qs))
        self.item.state.draft_proposal = proposal


def _chain_step(model, chains: list[Chain], j: int, block_size: int, sampler) -> None:
    """Chained MTP step j: one decode row per chain at position newest + j - 1, fed its
    latest draft and the previous MTP step's hidden state."""
    positions = [c.newest + j - 1 for c in chains]
    slices = [SeqSlice(1, pos + 1, c.item.state.block_ids) for c, pos in zip(chains, positions)]
    hidden = torch.stack([c.hidden for c in chains])  # type: ignore[misc]
    device = hidden.device
    attn = build_metadata([], slices, block_size, device)
    ids = torch.tensor([c.tokens[-1] for c in chains], device=device)
    layer = min(j, len(model.mtp_layers) - 1)
    out, _ = model.mtp_forward(layer, ids, torch.tensor(positions, device=device), hidden, attn)
    _extend(model, chains, out, sampler)


def _extend(model, chains: list[Chain], hidden: torch.Tensor, sampler) -> None:
    """Each chain's next draft from the MTP hidden states [P, H] (draft_sampling.py)."""
    logits = model.compute_logits(hidden)
    words = []
    for c in chains:
        state = c.item.state
        position = c.first_position + len(c.tokens)
        words.append(
            draft_words(state.params, state.sample_index, state.seq_id, sampler.seed, position)
        )
    params = [c.item.state.params for c in chains]
    tokens, probs = draw_drafts(logits, params, words, sampler.vocab_size)
    for c, h, token, q in zip(chains, hidden, tokens, probs):
        c.tokens.append(token)
        c.hidden = h
        if verified_by_ratio(c.item.state.params):
            c.qs.append(q)


def _next_tokens(
    scheduled: list[ScheduledRequest], step: StepInputs
) -> tuple[torch.Tensor, list[int | None]]:
    """(token p + 1 of each row p [T], each entry's row of its newest token or None)."""
    ids = torch.roll(step.input_ids, -1)
    rows: list[int | None] = []
    at = 0
    for item in scheduled:
        state = item.state
        if item.samples and state.last_sampled is not None:
            # (a row whose grammar mask was late sampled nothing: its draft is never used)
            row = at + item.num_new - 1 - len(item.drafts) + item.num_accepted
            ids[row] = state.last_sampled
            rows.append(row)
        else:
            end = state.num_computed_tokens + item.num_new
            if end < len(state.token_ids):  # the next prompt token
                ids[at + item.num_new - 1] = state.token_ids[end]
            rows.append(None)
        at += item.num_new
    return ids, rows


def attach_draft_probs(scheduled: list[ScheduledRequest]) -> None:
    """A verify row whose drafts are (a prefix of) the ones the MTP layers drew for its
    positions last step (and kept q for) is verified by min(1, p/q) against those q."""
    for item in scheduled:
        proposal = item.state.draft_proposal
        if item.drafts and proposal is not None:
            position, tokens, q = proposal
            n = len(item.drafts)
            if (position, tokens[:n]) == (item.state.num_output_tokens, item.drafts):
                item.draft_probs = q[:n]  # [n, V]
