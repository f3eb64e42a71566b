"""Where a verify batch's tokens sit in a verify graph's [rows, width] grid (torch-free).

Row i of the step takes grid row i; its `num_new` tokens fill the end of that row, so its
last token is at column width - 1 and each token keeps its own position (the grid's
positions run up to each row's context length). The columns before them are dummies: token
0 at the positions just before the row's first new token, written to the KV cache's scratch
slot, so the cache rows they would have overwritten (the row's own earlier tokens, already
computed) are kept, and attention, which derives each query's position from the context
length and the row's width, reads the same keys as the eager step's.
"""

from __future__ import annotations

from raylane.kernels.attention.metadata import SeqSlice


def verify_fits(seqs: list[SeqSlice], width: int, max_rows: int) -> bool:
    """Every row has at most `width` new tokens and at least `width` of context (the
    dummies' positions are real ones), some row more than one new token (else it is a
    decode batch), and the batch fits the largest verify graph."""
    return (
        0 < len(seqs) <= max_rows
        and all(s.num_new <= width <= s.context_len for s in seqs)
        and any(s.num_new > 1 for s in seqs)
    )


def grid_rows(seqs: list[SeqSlice], width: int) -> list[int]:
    """For each token of the step's flat layout (rows in order), its index in the
    row-major grid."""
    return [i * width + width - s.num_new + t for i, s in enumerate(seqs) for t in range(s.num_new)]
