"""Weight updates reach the drafter in the target's transaction: a draft model's tensors
(`draft.<name>`) and a checkpoint's MTP layers are switched with the target's at finish, and
a failed or aborted update leaves both as they were. References: the weights sent (the draft
model's parameters), an engine loaded from the updated checkpoint (MTP checksums), and the
engine without speculation updated the same way (tokens, versions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from raylane.actors.engine import SamplingParams
from raylane.actors.models.weights import specs_of

from tests.hf_reference import perturbed_model
from tests.unit.spec.helpers import Tap, make_loopy_llama, spec_engine
from tests.unit.spec.test_mtp import MTP, biased_copy
from tests.unit.spec.test_parity import K, assert_same, greedy
from tests.unit.test_mtp_layers import make_deepseek_v3_with_mtp

GREEDY = greedy(max_tokens=24)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("draft") / "model", attention_scale=0.03)


def draft_sums(engine) -> dict[str, str]:
    """The draft model's parameter checksums on the runners, by their names there."""
    sums = engine.upkeep.weight_checksums()
    return {n.removeprefix("draft."): v for n, v in sums.items() if n.startswith("draft.")}


def target_sums(engine) -> dict[str, str]:
    return {n: v for n, v in engine.upkeep.weight_checksums().items() if "draft." not in n}


def draft_engine(loopy_dir: str, other_dir: str):
    spec = {"method": "draft_model", "model": other_dir, "num_speculative_tokens": K}
    return spec_engine(loopy_dir, {**spec, "adaptive": False})


def test_draft_model_updates_with_the_target(loopy_dir, other_dir, reference, prompts, tmp_path):
    """Target and draft both get the target's new weights: the draft is then the target and
    every draft is accepted; tokens and versions are the non-speculative engine's."""
    _, v1 = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    engine = draft_engine(loopy_dir, other_dir)
    engine.generate(prompts[:1], GREEDY, use_tqdm=False)  # drafts from the old draft
    engine.update_weights(v1 + [(f"draft.{n}", t) for n, t in v1])
    # the reference: v1 loaded from its files
    fresh = spec_engine(str(tmp_path / "v1"), None, tokenizer=loopy_dir)
    assert draft_sums(engine) == target_sums(fresh)
    fresh.shutdown()
    reference.update_weights(v1)
    want = reference.generate(prompts, GREEDY, use_tqdm=False)
    reference.update_weights(perturbed_model(loopy_dir, str(tmp_path / "v0"), 0, 0.0)[1])
    tap = Tap(engine, K)
    got = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert_same(want, got)  # weight versions included: both at version 1
    assert {v for o in got for v in o.outputs[0].weight_versions} == {1}
    assert 0 < tap.num_accepted == tap.num_draft_tokens
    engine.shutdown()


def test_a_failed_update_changes_neither(loopy_dir, other_dir, tmp_path):
    _, v1 = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    draft = [(f"draft.{n}", t) for n, t in v1]
    engine = draft_engine(loopy_dir, other_dir)
    target_before, draft_before = target_sums(engine), draft_sums(engine)
    # refused at begin: a draft tensor of another shape, or one the draft does not have
    bad = [(draft[0][0], torch.zeros(3, 3))]
    for wrong in (bad, [("draft.model.nope.weight", torch.zeros(2))]):
        with pytest.raises(ValueError, match="draft"):
            engine.update_weights(v1 + wrong)
    # aborted after both parts went in
    engine.begin_weight_update(specs_of(v1 + draft))
    engine.load_weight_bucket(dict(v1))
    engine.load_weight_bucket(dict(draft))
    assert target_sums(engine) != target_before
    changed = draft_sums(engine)
    assert all(changed[n] != draft_before[n] for n in draft_before), "every draft tensor went in"
    engine.weights.abort()
    assert target_sums(engine) == target_before
    assert draft_sums(engine) == draft_before
    assert engine.weight_version == 0
    engine.shutdown()


def perturbed_checkpoint(path: str, out: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, MTP layers included, plus seeded noise, saved as its
    own model in `out`; returns the named tensors (what a trainer sends)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(9)
    for name, t in tensors.items():
        if t.is_floating_point():
            tensors[name] = t + 0.01 * torch.randn(t.shape, generator=gen)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return list(tensors.items())


def test_mtp_layers_update_with_the_target(tmp_path):
    path = biased_copy(make_deepseek_v3_with_mtp(tmp_path / "ds")[0], str(tmp_path / "biased"))
    weights = perturbed_checkpoint(path, tmp_path / "v1")
    mtp_names = [n for n, _ in weights if n.startswith("model.layers.2.")]  # the MTP layer
    assert mtp_names
    engine = spec_engine(path, MTP)
    before = engine.upkeep.weight_checksums()
    with pytest.raises(ValueError, match=mtp_names[0].replace(".", r"\.")):
        bad = [(n, t[..., :1] if n == mtp_names[0] else t) for n, t in weights]
        engine.update_weights(bad)
    assert engine.upkeep.weight_checksums() == before
    prompts = [list(range(5, 12)), list(range(5, 25))]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    engine.update_weights(weights)
    fresh = spec_engine(str(tmp_path / "v1"), None)
    assert engine.upkeep.weight_checksums() == fresh.upkeep.weight_checksums()
    tap = Tap(engine, 1)
    want = fresh.generate(prompts, params, use_tqdm=False)
    got = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert {v for o in got for v in o.outputs[0].weight_versions} == {1}
    assert tap.num_accepted > 0
    engine.shutdown()
    fresh.shutdown()


def test_draft_tensors_over_the_trainers_group(loopy_dir, other_dir, prompts, tmp_path):
    """A trainer's collective broadcast (gloo, tests/weight_trainer.py) carries `draft.*`
    tensors with the target's, into the ranks that hold the draft: after it the draft's
    checksums are those of the new weights loaded from their files, greedy output is an
    engine's loaded from them, and the draft (now the target) has every draft accepted."""
    import asyncio

    from raylane.actors.engine import EngineConfig
    from raylane.actors.engine.async_engine import AsyncLLMEngine
    from raylane.session_server.backend import local_backend
    from safetensors.torch import save_file

    from tests.unit.test_collective_weights import update
    from tests.weight_trainer import Trainer, trainer_specs

    v1_dir, v1 = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    both = tmp_path / "both"  # what the trainer sends: the target's tensors, then the draft's
    both.mkdir()
    save_file({**dict(v1), **{f"draft.{n}": t.clone() for n, t in v1}}, both / "model.safetensors")
    specs = trainer_specs(str(both))
    fresh = spec_engine(v1_dir, None, tokenizer=loopy_dir)  # the reference: v1 from its files
    want_sums = target_sums(fresh)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts[:2], params, use_tqdm=False)]
    fresh.shutdown()
    spec = {"method": "draft_model", "model": other_dir, "num_speculative_tokens": K}
    config = EngineConfig(
        model=loopy_dir, speculative_config={**spec, "adaptive": False}, num_kv_blocks=128
    )

    async def go():
        async_engine = AsyncLLMEngine.from_config(config)
        backend = local_backend(async_engine, "tiny")
        engine = async_engine.engine
        trainer = Trainer(str(both), specs)
        try:
            await backend.control.init_weight_group(trainer.info())
            assert await update(backend, trainer, specs) == 1
            assert draft_sums(engine) == want_sums
            tap = Tap(engine, K)
            for prompt, tokens in zip(prompts[:2], want):
                assert await collect(async_engine, prompt, params) == tokens
            assert 0 < tap.num_accepted == tap.num_draft_tokens
        finally:
            trainer.close()
            await async_engine.shutdown()

    asyncio.run(go())


async def collect(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    async for out in engine.generate(prompt, params, f"r{len(prompt)}"):
        last = out
    return last.outputs[0].token_ids
