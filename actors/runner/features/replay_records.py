"""The per-slot replay records a step reports (routed experts, a DSA model's indexer top-k):
each asking sequence's positions newly in its record, read from the device in one copy."""

from __future__ import annotations

from collections.abc import Callable

from raylane.actors.runner.requests import ScheduledRequest


def report_new_positions(
    scheduled: list[ScheduledRequest], column: list, kind: str, read: Callable
) -> None:
    """Fill `column[i]` with entry i's positions newly in its `kind` ("routed", "indexer")
    record: a cache hit's prefix, then this chunk; `read(spans)` copies them from the device."""
    asked = "return_routed_experts" if kind == "routed" else "return_indexer_topk"
    counter = f"num_{kind}_reported"
    rows, spans = [], []
    for i, item in enumerate(scheduled):
        state = item.state
        # a verify row's rejected drafts are no positions of the sequence
        start = getattr(state, counter)
        end = item.context_len - len(item.drafts) + item.num_accepted
        # end <= start: a recompute after preemption, already reported
        if getattr(state.params, asked) and end > start:
            setattr(state, counter, end)
            rows.append(i)
            spans.append((state.block_ids, start, end))
    if spans:
        for i, record in zip(rows, read(spans)):
            column[i] = record
