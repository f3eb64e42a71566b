"""Session-wide fixtures: tiny random models built offline, the embedded SmolLM2, and one local
Ray cluster shared by every module that can share it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton decides interpreter mode partly when it is first imported, and transformers may import
# it while any test module loads: without a GPU, set interpreter mode before anything does (the
# Triton kernel tests run on the CPU through it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support import ray_cluster as shared_ray
from tests.tiny_models import (
    make_deepseek_v3,
    make_glm4_moe,
    make_llama,
    make_qwen3,
    make_qwen3_moe,
)

torch.set_num_threads(min(2, torch.get_num_threads()))  # the machine's cores are shared
shared_ray.set_env()  # also for the modules that start a Ray cluster of their own


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama, 2 layers, 4 heads / 2 KV heads, head_dim 16, untied."""
    return make_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3, 3 layers, q/k norm, head_dim 32 (!= hidden / heads)."""
    return make_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3 (MLA + grouped sigmoid routing), see tests/tiny_models.make_deepseek_v3."""
    return make_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek"))


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GLM-4.5-style MoE (GQA, partial rotary), see tests/tiny_models.make_glm4_moe."""
    return make_glm4_moe(tmp_path_factory.mktemp("tiny_glm4_moe"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-MoE, 4 layers (0, 2 dense; 1, 3 MoE with 8 experts, top-2)."""
    return make_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model's HF directory (converted once, then cached)."""
    from raylane.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's local Ray cluster (yields the `ray` module). What the module deployed on it
    is stopped after the module; Ray stays up for the next one."""
    ray = shared_ray.start()
    yield ray
    shared_ray.stop_apps()


RAY_TESTS = Path(__file__).parent / "ray"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs a Ray cluster is marked `ray` (`make test-fast` leaves them out),
    and modules marked `own_ray_cluster` run last, so the shared cluster starts once, not again
    after each of them."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) or RAY_TESTS in item.path.parents:
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is not None)


def pytest_terminal_summary(terminalreporter) -> None:
    if shared_ray.starts:
        terminalreporter.write_line(f"shared Ray cluster started {shared_ray.starts} time(s)")


@pytest.fixture(scope="session")
def tiny_dsa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3.2 (DSA, index_topk 12), see tests/tiny_models.make_deepseek_v32."""
    from tests.tiny_models import make_deepseek_v32

    return make_deepseek_v32(tmp_path_factory.mktemp("tiny_dsa"))


@pytest.fixture(scope="session")
def tiny_glm5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GLM-5 (GlmMoeDsa, shared indexer layers), see tests/tiny_models.make_glm_moe_dsa."""
    from tests.tiny_models import make_glm_moe_dsa

    return make_glm_moe_dsa(tmp_path_factory.mktemp("tiny_glm5"))
