"""The engine side of the RL control plane: weight updates, pause modes, per-token weight
versions, the version-aware prefix cache, max_weight_lag and kept mass.

References: Hugging Face `generate` on the perturbed weights (saved to their own directory),
and a naive per-row computation of the kept mass from HF logits.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.async_engine import AsyncLLMEngine
from raylane.actors.engine.errors import EnginePaused
from raylane.actors.models.weights import TensorSpec, encode_bucket, specs_of

from tests.hf_reference import hf_greedy, hf_model, perturbed_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def perturbed(tiny_llama_dir, tmp_path_factory) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """v1 weights: v0 plus seeded noise, as named HF tensors and saved as their own model."""
    return perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_llama_v1")), 11)


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=tiny_llama_dir, max_num_batched_tokens=256, num_kv_blocks=64)
    )


def prompts_for(engine, count=3, length=20) -> list[list[int]]:
    vocab = engine.validator.vocab_size
    return [
        [(5 * i + 3 * j) % (vocab - 5) + 5 for j in range(length + 4 * i)] for i in range(count)
    ]


def greedy_ids(engine, prompts, max_tokens=8):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return outs


# --- offline updates -----------------------------------------------------------------------


def test_update_equals_hf_on_new_weights_even_for_a_cached_prefix(
    engine, tiny_llama_dir, perturbed
):
    v1_dir, v1 = perturbed
    prompts = prompts_for(engine)
    before = greedy_ids(engine, prompts)
    assert [o.outputs[0].token_ids for o in before] == [
        hf_greedy(tiny_llama_dir, p, 8)[0] for p in prompts
    ]
    engine.update_weights(v1, version=1, bucket_bytes=20_000)  # many buckets
    after = greedy_ids(engine, prompts)
    for out, prompt in zip(after, prompts):
        ids, logprobs = hf_greedy(v1_dir, prompt, 8)
        assert out.outputs[0].token_ids == ids
        assert out.outputs[0].weight_versions == [1] * 8
        assert out.weight_version == 1
        # its prefix was cached under version 0: not reused under version 1
        assert out.num_cached_tokens == 0
    again = greedy_ids(engine, prompts)  # now cached under version 1, and reused
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in after]
    assert [o.outputs[0].weight_versions for o in before] == [[0] * 8] * 3


def test_bad_update_changes_nothing(engine, perturbed):
    _, v1 = perturbed
    prompts = prompts_for(engine, 2)
    before = [o.outputs[0].token_ids for o in greedy_ids(engine, prompts)]
    name, tensor = v1[3]
    wrong = [TensorSpec(name, (tensor.shape[0] + 1, *tensor.shape[1:]), "float32")]
    with pytest.raises(ValueError, match="expected|shape"):
        engine.begin_weight_update(wrong)
    with pytest.raises(ValueError, match="matches no model parameter"):
        engine.begin_weight_update([TensorSpec("model.nope.weight", (4,), "float32")])
    # a bucket that is not what its manifest declared is refused before any copy
    engine.begin_weight_update(specs_of(v1[:2]))
    with pytest.raises(ValueError, match="not in the update's manifest"):
        engine.load_weight_bucket(encode_bucket(v1[2:4]))
    with pytest.raises(ValueError, match="manifest says"):
        engine.load_weight_bucket({v1[0][0]: v1[0][1].to(torch.float16)})
    assert not engine.weight_update_open
    with pytest.raises(ValueError, match="not newer"):
        engine.finish_weight_update(0)
    assert engine.weight_version == 0
    assert [o.outputs[0].token_ids for o in greedy_ids(engine, prompts)] == before


def test_finish_without_begin_and_garbage_buckets(engine):
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.finish_weight_update()
    engine.begin_weight_update([])
    with pytest.raises(ValueError, match="safetensors"):
        engine.load_weight_bucket(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


# --- pause modes (AsyncLLMEngine) -----------------------------------------------------------


async def _start(aeng, prompts, params, prefix="r"):
    """Launch requests; returns the tasks and a dict of their latest outputs."""
    latest: dict[str, object] = {}

    async def consume(rid, prompt):
        async for out in aeng.generate(prompt, params, rid):
            latest[rid] = out
        return latest[rid]

    tasks = [asyncio.create_task(consume(f"{prefix}{i}", p)) for i, p in enumerate(prompts)]
    return tasks, latest


async def _until(latest, rids, tokens):
    while not all(
        rid in latest and len(latest[rid].outputs[0].token_ids) >= tokens for rid in rids
    ):
        await asyncio.sleep(0.002)


def _progress(aeng, rid):
    return aeng.engine.requests[rid].seqs[0].num_output_tokens


def test_keep_and_retract_switch_versions_where_the_update_happened(
    engine, tiny_llama_dir, perturbed
):
    v1_dir, v1 = perturbed
    prompts = prompts_for(engine, 2)
    params = SamplingParams(max_tokens=12, **GREEDY)

    async def main():
        aeng = AsyncLLMEngine(engine)
        tasks, latest = await _start(aeng, prompts, params)
        await _until(latest, ["r0", "r1"], 3)
        await aeng.pause("keep")
        kept = {rid: _progress(aeng, rid) for rid in ("r0", "r1")}
        await aeng.pause("retract")  # applies to what is in flight: frees their KV
        assert aeng.engine.block_manager.num_free_blocks == aeng.engine.block_manager.num_blocks
        aeng.begin_weight_update(specs_of(v1))
        aeng.load_weight_bucket(encode_bucket(v1))
        assert aeng.finish_weight_update(1) == 1
        await aeng.resume()
        return kept, await asyncio.gather(*tasks)

    kept, outs = asyncio.run(main())
    for out, prompt, rid in zip(outs, prompts, ("r0", "r1")):
        done = kept[rid]
        ids = out.outputs[0].token_ids
        assert out.outputs[0].weight_versions == [0] * done + [1] * (12 - done)
        assert ids[:done] == hf_greedy(tiny_llama_dir, prompt, done)[0]
        # retracted: the continuation is what fresh v1 weights give on prompt + partial output
        assert ids[done:] == hf_greedy(v1_dir, prompt + ids[:done], 12 - done)[0]


def test_keep_continues_with_its_kv_and_abort_frees_everything(engine, tiny_llama_dir):
    prompts = prompts_for(engine, 3)
    params = SamplingParams(max_tokens=10, **GREEDY)

    async def main():
        aeng = AsyncLLMEngine(engine)
        tasks, latest = await _start(aeng, prompts[:2], params)
        await _until(latest, ["r0", "r1"], 2)
        await aeng.pause("keep")
        frozen = {rid: _progress(aeng, rid) for rid in ("r0", "r1")}
        await asyncio.sleep(0.05)
        assert {rid: _progress(aeng, rid) for rid in ("r0", "r1")} == frozen  # no step ran
        await aeng.resume()
        kept_outs = await asyncio.gather(*tasks)
        tasks, latest = await _start(aeng, prompts, params, prefix="a")
        await _until(latest, ["a0", "a1", "a2"], 2)
        await aeng.pause("abort")
        aborted = await asyncio.gather(*tasks)
        await aeng.resume()
        return kept_outs, aborted

    kept_outs, aborted = asyncio.run(main())
    for out, prompt in zip(kept_outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 10)[0]
        assert out.outputs[0].weight_versions == [0] * 10
    for out, prompt in zip(aborted, prompts):
        ids = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "abort" and 2 <= len(ids) < 10
        assert ids == hf_greedy(tiny_llama_dir, prompt, len(ids))[0]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests


def test_wait_lets_in_flight_finish_and_queues_new_requests_bounded(
    engine, tiny_llama_dir, perturbed
):
    v1_dir, v1 = perturbed
    prompts = prompts_for(engine, 3)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def main():
        aeng = AsyncLLMEngine(engine, max_paused_requests=1)
        tasks, latest = await _start(aeng, prompts[:2], params)
        await _until(latest, ["r0"], 1)
        await aeng.pause("wait")
        assert all(t.done() for t in tasks)  # "wait" returns once in-flight requests ended
        queued, _ = await _start(aeng, prompts[2:], params, prefix="q")
        await asyncio.sleep(0.02)
        with pytest.raises(EnginePaused):  # the paused queue holds one request
            async for _ in aeng.generate(prompts[0], params, "over"):
                pass
        with pytest.raises(ValueError, match="token"):  # bad input fails at once
            async for _ in aeng.generate([10**6], params, "bad"):
                pass
        aeng.begin_weight_update(specs_of(v1))
        aeng.load_weight_bucket(dict(v1))
        aeng.finish_weight_update()
        await aeng.resume()
        await aeng.resume()  # idempotent
        return await asyncio.gather(*tasks), await asyncio.gather(*queued)

    done, queued = asyncio.run(main())
    for out, prompt in zip(done, prompts):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 6)[0]
        assert out.outputs[0].weight_versions == [0] * 6
    assert queued[0].outputs[0].token_ids == hf_greedy(v1_dir, prompts[2], 6)[0]
    assert queued[0].outputs[0].weight_versions == [1] * 6


def test_update_needs_a_pause_and_resume_refuses_a_half_loaded_update(engine, perturbed):
    _, v1 = perturbed

    async def main():
        aeng = AsyncLLMEngine(engine)
        with pytest.raises(RuntimeError, match="pause"):
            aeng.begin_weight_update(specs_of(v1))
        with pytest.raises(ValueError, match="mode"):
            await aeng.pause("sleep")
        await aeng.pause("keep")
        aeng.begin_weight_update(specs_of(v1))
        aeng.load_weight_bucket(dict(v1[:2]))
        with pytest.raises(RuntimeError, match="half loaded"):
            await aeng.resume()
        aeng.load_weight_bucket(dict(v1[2:]))
        aeng.finish_weight_update()
        await aeng.resume()
        assert aeng.paused_mode is None and aeng.weight_version == 1

    asyncio.run(main())


def test_max_weight_lag_ends_a_request_as_stale(engine, tiny_llama_dir, perturbed):
    _, v1 = perturbed
    prompts = prompts_for(engine, 2)
    strict = SamplingParams(max_tokens=12, max_weight_lag=0, **GREEDY)
    loose = SamplingParams(max_tokens=12, max_weight_lag=1, **GREEDY)

    async def main():
        aeng = AsyncLLMEngine(engine)
        latest: dict = {}

        async def consume(rid, prompt, params):
            async for out in aeng.generate(prompt, params, rid):
                latest[rid] = out
            return latest[rid]

        tasks = [
            asyncio.create_task(consume("s", prompts[0], strict)),
            asyncio.create_task(consume("l", prompts[1], loose)),
        ]
        await _until(latest, ["s", "l"], 2)
        await aeng.pause("keep")
        done = _progress(aeng, "s")
        aeng.begin_weight_update(specs_of(v1))
        aeng.load_weight_bucket(dict(v1))
        aeng.finish_weight_update()
        await aeng.resume()
        return done, await asyncio.gather(*tasks)

    done, (stale, loose_out) = asyncio.run(main())
    assert stale.outputs[0].finish_reason == "stale"
    assert stale.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompts[0], done)[0]
    assert loose_out.outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# --- kept mass ------------------------------------------------------------------------------


def _naive_kept(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> float:
    """log of the mass top-k / top-p / min-p keep, one row, with plain Python loops."""
    if temperature == 0:
        probs = torch.softmax(logits.double(), -1).tolist()
        return math.log(max(probs))
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[:top_k] if top_k > 0 else order
    nucleus, mass = [], 0.0
    for t in kept:
        if mass >= top_p:
            break
        nucleus.append(t)
        mass += probs[t] / sum(probs[u] for u in kept)
    biggest = probs[order[0]]
    final = [t for t in nucleus if probs[t] >= min_p * biggest]
    return math.log(sum(probs[t] for t in final))


KNOBS = [
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.0},
    {"temperature": 1.2, "top_k": 0, "top_p": 0.7, "min_p": 0.05},
    {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
]


@pytest.mark.parametrize("knobs", KNOBS, ids=["topk-topp", "topp-minp", "greedy"])
def test_kept_mass_equals_a_naive_computation(engine, tiny_llama_dir, knobs):
    prompt = prompts_for(engine, 1)[0]
    params = SamplingParams(max_tokens=6, seed=3, return_kept_mass=True, ignore_eos=True, **knobs)
    other = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # a row not asking
    out, plain = engine.generate([prompt, prompt[:-1]], [params, other], use_tqdm=False)
    got = out.outputs[0].kept_mass_logprobs
    assert plain.outputs[0].kept_mass_logprobs is None and len(got) == 6
    ids = out.outputs[0].token_ids
    model = hf_model(tiny_llama_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    want = [_naive_kept(row, **knobs) for row in logits]
    assert got == pytest.approx(want, abs=1e-4)
    if knobs["temperature"] > 0:
        assert min(got) < -1e-3  # truncation did cut something
