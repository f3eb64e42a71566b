"""The sampler's reductions over a row of logits: log_softmax (logprobs, top-logprobs, prompt
logprobs) and logsumexp (the kept mass).

torch's serve the CPU, where its reductions within a row keep one order whatever the row
count, and every device outside the batch-invariant mode. In the mode on CUDA (`on_triton`)
the row-wise Triton kernels take them (triton_rowwise.py), so a row's logprobs never follow
the batch, and `raylane.batch_invariant()` runs the same log_softmax for a trainer's
`torch.log_softmax(logits.float(), -1)`: the two are bitwise equal.
"""

from __future__ import annotations

import torch
from raylane.kernels.batch_invariant.backend import on_triton


class RowReductions:
    """torch's own."""

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] float32 -> [B, V] float32."""
        return x.log_softmax(dim=-1)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] float32 -> [B] float32."""
        return x.logsumexp(dim=-1)


class TritonRowReductions(RowReductions):
    """The Triton kernels of one order per row."""

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        from raylane.kernels.batch_invariant.triton_rowwise import log_softmax

        return log_softmax(x)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        from raylane.kernels.batch_invariant.triton_rowwise import logsumexp

        return logsumexp(x)


def row_reductions(batch_invariant: bool, device: torch.device) -> RowReductions:
    """The reductions a sampler on `device` runs, in the batch-invariant mode or not."""
    return TritonRowReductions() if batch_invariant and on_triton(device) else RowReductions()
