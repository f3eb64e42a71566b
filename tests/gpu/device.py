"""Where the GPU checks run: CUDA, or another device named by RAYLANE_GPU_TESTS_DEVICE (`cpu`
dry-runs their logic on a machine without a GPU, before a lent GPU's minutes are spent; the
graph and Triton checks, which only mean something on CUDA, skip there)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("RAYLANE_GPU_TESTS_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"

needs_device = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)
# checks that need no GPU but take minutes on the CPU: GPU runs and their dry runs only
in_gpu_lane = pytest.mark.skipif(
    not torch.cuda.is_available() and "RAYLANE_GPU_TESTS_DEVICE" not in os.environ,
    reason="a GPU-lane check (run_all.sh, or RAYLANE_GPU_TESTS_DEVICE=cpu)",
)
needs_cuda = pytest.mark.skipif(not (ON_CUDA and torch.cuda.is_available()), reason="CUDA only")


def synchronize() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()
