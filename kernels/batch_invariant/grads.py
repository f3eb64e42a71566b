"""The invariant kernels' backwards, in plain torch ops (the backward need not be
batch-invariant): the linears' (linear.py's padded matmul, triton_matmul.py's kernel) and,
for the rest (attention, RMSNorm, the gated delta rule), the gradients of the same math
recomputed in torch ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Grad = torch.Tensor | None


def linear_grads(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """A linear's gradients (rows, weight, bias) from the (rows, weight) a forward saved and
    its `has_bias`: the invariant forwards' backward, in plain torch ops."""
    rows, weight = ctx.saved_tensors
    grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
    grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_rows, grad_weight, grad_bias


def recomputed_grads(
    compute: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor | None],
    grads: Sequence[Grad],
) -> list[Grad]:
    """Per input, its gradient through `compute(*inputs)` (the forward's math in torch ops)
    given the gradients of its outputs (`grads`, one per output; None: that output got none);
    None for the inputs that are None or need none."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
        outs = compute(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(out, grad.to(out.dtype)) for out, grad in zip(outs, grads) if grad is not None]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        found = iter(
            torch.autograd.grad(
                [out for out, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        )
    return [next(found) if t is not None and t.requires_grad else None for t in leaves]
