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
"""

from __future__ import annotations

import torch
from raylane.actors.runner.draft_sampling import draft_words, draw_drafts, verified_by_ratio
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.requests import ScheduledRequest


def mtp_drafts(
    model, scheduled: list[ScheduledRequest], step: StepInputs, hidden: torch.Tensor, sampler
) -> list[int | None]:
    """Run MTP layer 0 over the step's rows (hidden [T, H] of the main forward); per entry,
    the draft for the token after its newest one (None where it sampled nothing)."""
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
    out, _ = model.mtp_forward(0, ids, step.positions, hidden, step.attn)
    picked = [i for i, r in enumerate(rows) if r is not None]
    if not picked:
        return [None] * len(rows)
    index = torch.tensor([rows[i] for i in picked], device=out.device)
    logits = model.compute_logits(out.index_select(0, index))
    drafts: list[int | None] = [None] * len(rows)
    for i, token in zip(picked, _draw(scheduled, picked, logits, sampler)):
        drafts[i] = token
    return drafts


def _draw(scheduled: list[ScheduledRequest], picked: list[int], logits, sampler) -> list[int]:
    """Each picked entry's draft from the MTP logits [P, V] (draft_sampling.py); where min(1,
    p/q) verifies it, its q is kept on the request for the step that verifies it."""
    items = [scheduled[i] for i in picked]
    # the draft's output position: after this step's token and accepted drafts
    positions = [it.state.num_output_tokens + it.num_accepted + 1 for it in items]
    words = [
        draft_words(it.state.params, it.state.sample_index, it.state.seq_id, sampler.seed, pos)
        for it, pos in zip(items, positions)
    ]
    params = [it.state.params for it in items]
    tokens, probs = draw_drafts(logits, params, words, sampler.vocab_size)
    for it, pos, token, q in zip(items, positions, tokens, probs):
        ratio = verified_by_ratio(it.state.params)
        it.state.draft_proposal = (pos, token, q) if ratio else None
    return tokens


def attach_draft_probs(scheduled: list[ScheduledRequest]) -> None:
    """A verify row whose draft is the one the MTP layer drew for its position last step
    (and kept q for) is verified by min(1, p/q) against that q."""
    for item in scheduled:
        proposal = item.state.draft_proposal
        if item.drafts and proposal is not None:
            position, token, q = proposal
            if (position, token) == (item.state.num_output_tokens, item.drafts[0]):
                item.draft_probs = q.unsqueeze(0)  # [1, V]
