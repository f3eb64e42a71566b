"""Collective weight transfer over NCCL (actors/runner/nccl_group.py) into an in-process engine
on cuda:0, from a trainer process on cuda:1 whose side is built as vLLM's trainer helper
builds it (vLLM's own `StatelessProcessGroup` + `PyNcclCommunicator` when vLLM imports, and
always an implementation of that wire of our own: tests/gpu/nccl_trainer.py), through the
control plane the vLLM routes drive: pause(keep) -> begin -> receive || broadcast (vLLM's
packed chunks) -> commit -> resume. The greedy output then equals Hugging Face's on the new
weights on the same GPU, at version 1; a mismatched update changes nothing.

Two GPUs: NCCL refuses two ranks of one communicator on one device. The CPU path (gloo) is
tests/unit/test_collective_weights.py.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from raylane.actors.engine import EngineConfig, SamplingParams
from raylane.actors.engine.async_engine import AsyncLLMEngine
from raylane.session_server.backend import local_backend

from tests.gpu.device import ON_CUDA
from tests.hf_reference import hf_greedy, perturbed_model
from tests.weight_trainer import GROUP, Trainer, trainer_specs

two_gpus = pytest.mark.skipif(
    not (ON_CUDA and torch.cuda.is_available() and torch.cuda.device_count() >= 2),
    reason="NCCL weight transfer needs two CUDA GPUs (NCCL refuses two ranks of one "
    "communicator on one GPU); the CPU's gloo path is tests/unit/test_collective_weights.py",
)
SIDES = ["ctypes", "vllm"]
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(12 + 5 * i)] for i in range(2)]


class NcclTrainer(Trainer):
    """The trainer on cuda:1 (tests/gpu/nccl_trainer.py), vLLM's packed chunks."""

    backend = "nccl"
    module = "tests.gpu.nccl_trainer"

    def __init__(self, side: str, v1_dir: str, specs: list[dict]) -> None:
        super().__init__(v1_dir, specs, device="cuda:1", side=side, packed=True, buffer=1 << 16)


async def greedy(engine: AsyncLLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = []
    for i, prompt in enumerate(PROMPTS):
        async for out in engine.generate(prompt, params, f"nccl-{i}"):
            last = out
        ids.append(last.outputs[0].token_ids)
    return ids


def test_the_trainer_sides_published_id_reads_as_raylanes():
    """The id exchange of the ctypes side, without a GPU: raylane's receiver reads it."""
    from raylane.actors.runner.nccl_group import read_unique_id

    from tests.gpu.nccl_trainer import ncclUniqueId, published

    theirs = ncclUniqueId()
    for i in range(128):
        theirs.internal[i] = (5 * i) % 256 - 128
    ours = read_unique_id(published(theirs))
    assert type(ours) is not ncclUniqueId and bytes(ours) == bytes(theirs)


@two_gpus
@pytest.mark.parametrize("side", SIDES)
def test_a_vllm_style_nccl_trainer_updates_the_engine(side, tiny_llama_dir, tmp_path):
    if side == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: its own trainer helper cannot run (ctypes did)")
    v1_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v1"), 7)
    specs = trainer_specs(v1_dir)
    want = [hf_greedy(v1_dir, p, 6, device="cuda:0")[0] for p in PROMPTS]
    bad = [
        dict(s, shape=[n + 1 for n in s["shape"]]) if "q_proj" in s["name"] else s for s in specs
    ]
    packing = {"packed": True, "buffer_bytes": 1 << 16}

    async def go() -> None:
        config = EngineConfig(
            model=tiny_llama_dir, device="cuda", dtype="float32", max_model_len=512,
            num_kv_blocks=64, enforce_eager=True,
        )  # fmt: skip
        engine = AsyncLLMEngine.from_config(config)
        control, trainer = local_backend(engine, "tiny").control, NcclTrainer(side, v1_dir, specs)
        try:
            before = await greedy(engine)
            await control.init_weight_group(trainer.info())  # joins with the trainer's comm
            assert trainer.line() == "joined"
            await control.pause("keep")
            await control.begin_update(None, None)
            with pytest.raises(ValueError, match="q_proj"):  # refused before a byte moved
                await control.receive_weights(None, GROUP, bad, packing)
            await control.resume()
            assert await greedy(engine) == before
            assert await control.weight_version() == 0
            trainer.close()  # the refusal left the group: a fresh one for the update
            trainer = NcclTrainer(side, v1_dir, specs)
            await control.init_weight_group(trainer.info())
            assert trainer.line() == "joined"
            await control.pause("keep")
            await control.begin_update(None, None)
            trainer.send()
            await control.receive_weights(None, GROUP, specs, packing)
            assert await control.commit_update(None) == 1
            await control.resume()
            assert trainer.line() == "sent"
            assert await greedy(engine) == want
        finally:
            trainer.close()
            await engine.shutdown()

    asyncio.run(go())
