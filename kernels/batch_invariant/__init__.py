"""Batch-invariant kernels: a row's result depends on that row alone, never on how many rows
share the call or where it sits among them. The engine's batch-invariant mode runs its models
through them, and `raylane.batch_invariant()` swaps them into a trainer's transformers model,
so the trainer's forward of a rollout equals the engine's bit for bit (docs/rl.md).

Measured on the CPU (torch 2.13, oneDNN; tests/unit/test_batch_invariant_kernels.py):
- `F.linear` is not row-invariant in float32 at any M, and in bfloat16 its M = 1 path (a GEMV)
  rounds otherwise than M >= 2 on real activations (random normal inputs hide it: their sums
  are exact in float32). One call with M padded to a multiple of ROW_BLOCK rows is: every
  row's dot products then take one order at every M, position and thread count.
- The C paged-attention kernel already is (one order per query row, whatever the tile, chunk
  or batch); RMSNorm, the gated activation, RoPE, log_softmax and the MoE combine in torch ops
  reduce within a row.

On CUDA (not yet run on a GPU; checked under TRITON_INTERPRET=1): cuBLAS picks its tiling and
split-K by M and torch's reductions size their blocks by the row count, so the mode runs
Triton kernels of one fixed order per row instead: the matmul (triton_matmul.py), RMSNorm,
the sampler's log_softmax and logsumexp (triton_rowwise.py, row_reductions.py), the experts
(triton_experts.py) and attention as one-split decodes (triton_attention.py); inside
`raylane.batch_invariant()` a trainer's transformers model takes the same (trainer_cuda.py).
`backend.on_triton` says which path a device's tensors take.
"""

from raylane.kernels.batch_invariant.backend import batch_invariant_backend
from raylane.kernels.batch_invariant.linear import ROW_BLOCK, grouped_linear, padded_linear

__all__ = ["ROW_BLOCK", "batch_invariant_backend", "grouped_linear", "padded_linear"]
