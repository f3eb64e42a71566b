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
the next step is the argmax of the MTP logits at that row: a point mass, so verification
stays exact (spec_verify.py).
"""

from __future__ import annotations

import torch
from raylane.actors.runner.inputs import StepInputs
from raylane.actors.runner.requests import ScheduledRequest


def mtp_drafts(
    model, scheduled: list[ScheduledRequest], step: StepInputs, hidden: torch.Tensor
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
    picked = [r for r in rows if r is not None]
    if not picked:
        return [None] * len(rows)
    index = torch.tensor(picked, device=out.device)
    drafts = iter(model.compute_logits(out.index_select(0, index)).argmax(-1).tolist())
    return [next(drafts) if r is not None else None for r in rows]
