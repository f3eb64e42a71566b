"""The invariant linears' backward (linear.py's padded matmul, triton_matmul.py's kernel),
in plain torch ops: the backward need not be batch-invariant."""

from __future__ import annotations

import torch


def linear_grads(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """A linear's gradients (rows, weight, bias) from the (rows, weight) a forward saved and
    its `has_bias`: the invariant forwards' backward, in plain torch ops."""
    rows, weight = ctx.saved_tensors
    grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
    grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_rows, grad_weight, grad_bias
