"""Session-wide fixtures: tiny random models built offline and the embedded SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides interpreter mode partly when it is first imported, and transformers may import
# it while any test module loads: without a GPU, set interpreter mode before anything does (the
# Triton kernel tests run on the CPU through it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import make_llama, make_qwen3, make_qwen3_moe

torch.set_num_threads(min(2, torch.get_num_threads()))  # the machine's cores are shared


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama, 2 layers, 4 heads / 2 KV heads, head_dim 16, untied."""
    return make_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3, 3 layers, q/k norm, head_dim 32 (!= hidden / heads)."""
    return make_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-MoE, 4 layers (0, 2 dense; 1, 3 MoE with 8 experts, top-2)."""
    return make_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model's HF directory (converted once, then cached)."""
    from raylane.models import default_model_path

    return default_model_path()
