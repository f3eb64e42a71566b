"""Collective weight transfer into an in-process engine (TP=1 executor), through the control
plane that the trainer routes drive: a trainer process (tests/weight_trainer.py, SGLang's
group scheme) broadcasts the perturbed weights; greedy output must then equal HF on those
weights (loaded by HF from their own directory), and a bad or broken update must leave the old
weights and version everywhere."""

from __future__ import annotations

import asyncio

import pytest
from raylane.actors.engine import EngineConfig, SamplingParams
from raylane.actors.engine.async_engine import AsyncLLMEngine
from raylane.router.errors import ReplicasFailed
from raylane.session_server.backend import Backend, local_backend

from tests.hf_reference import hf_greedy, perturbed_model
from tests.schema_checks import answer_problems
from tests.weight_trainer import GROUP, Trainer, trainer_specs
from tests.weight_versions import everywhere_as, versions_everywhere


@pytest.fixture(scope="module")
def v1(tiny_llama_dir, tmp_path_factory) -> tuple[str, list[dict]]:
    """The new weights' directory, and their specs as a trainer announces them (file order)."""
    out, _ = perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("v1")), 7)
    return out, trainer_specs(out)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 5 for j in range(12 + 5 * i)] for i in range(3)]


async def greedy(engine: AsyncLLMEngine, prompt: list[int], rid: str) -> tuple[list[int], set]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(prompt, params, rid):
        last = out
    return last.outputs[0].token_ids, {last.weight_version}


async def update(backend: Backend, trainer: Trainer, specs, packing=None) -> int:
    """vLLM's sequence: pause(keep), start_weight_update, update_weights while the trainer
    broadcasts, finish_weight_update, resume."""
    control = backend.control
    await control.pause("keep")
    await control.begin_update(None, None)  # an open-ended update: its receives bring specs
    trainer.send()
    await control.receive_weights(None, GROUP, specs, packing)
    version = await control.commit_update(None)
    await control.resume()
    return version


async def outputs(backend: Backend) -> list:
    return [await greedy(backend.requests.engine, p, f"r{i}") for i, p in enumerate(prompts())]


def with_backend(model_dir: str, test) -> None:
    """Run `test(backend)` on one event loop, which the async engine lives on."""

    async def go():
        config = EngineConfig(model=model_dir, max_num_batched_tokens=256, num_kv_blocks=64)
        backend = local_backend(AsyncLLMEngine.from_config(config), "tiny")
        try:
            await test(backend)
        finally:
            await backend.requests.engine.shutdown()

    asyncio.run(go())


def test_a_mismatch_changes_nothing_and_a_broken_update_rolls_back(tiny_llama_dir, v1):
    v1_dir, specs = v1
    i = next(i for i, s in enumerate(specs) if "q_proj" in s["name"])
    bad = [*specs[:i], dict(specs[i], shape=[s + 1 for s in specs[i]["shape"]]), *specs[i + 1 :]]

    async def test(backend):
        control = backend.control
        before = await outputs(backend)
        hf = [hf_greedy(tiny_llama_dir, p, 6)[0] for p in prompts()]
        assert [ids for ids, _ in before] == hf
        trainer = Trainer(v1_dir, specs)
        try:
            await control.init_weight_group(trainer.info())
            await control.pause("keep")
            await control.begin_update(None, None)
            with pytest.raises(ValueError, match="q_proj"):
                await control.receive_weights(None, GROUP, bad)  # refused before a byte moved
            await control.resume()
        finally:
            trainer.close()
        assert await outputs(backend) == before
        trainer = Trainer(v1_dir, specs, stop_after=len(specs) // 2)
        try:
            await control.init_weight_group(trainer.info())
            with pytest.raises(ReplicasFailed, match="rolled back"):
                await update(backend, trainer, specs)  # the trainer dies halfway
        finally:
            trainer.close()
        await control.resume()
        assert await control.weight_version() == 0
        assert await outputs(backend) == before  # the old weights, at version 0

    with_backend(tiny_llama_dir, test)


def test_the_vllm_and_sglang_routes_follow_the_peers_sequences(tiny_llama_dir, v1):
    """vLLM: pause(keep) -> start_weight_update -> update_weights || broadcast (packed) ->
    finish_weight_update -> resume; SGLang (slime's buckets): pause_generation -> init group ->
    update_weights_from_distributed x 2, the same weight_version || per-tensor broadcast ->
    continue_generation. A request kept in flight across the vLLM update carries version 0
    before it and 1 after; the labels the trainers gave ("step-42", then "7") are what every
    trainer route answers for those versions."""
    import httpx
    from raylane.session_server.app import build_app

    v1_dir, specs = v1
    names = [s["name"] for s in specs]
    meta = {"dtype_names": ["float32"] * len(specs), "shapes": [s["shape"] for s in specs]}

    async def test(backend):
        app = build_app(backend, trainer_api=True)
        transport = httpx.ASGITransport(app=app)
        answers: list[httpx.Response] = []  # every answer, checked against the schema at the end

        async def keep(answer: httpx.Response) -> None:
            await answer.aread()
            # the schema documents a stream as text, not its chunks
            if not answer.headers.get("content-type", "").startswith("text/event-stream"):
                answers.append(answer)

        hooks = {"response": [keep]}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", event_hooks=hooks
        ) as http:
            trainer = Trainer(v1_dir, specs, packed=True, buffer=3000)
            try:
                r = await http.post("/init_weight_transfer_engine", json={"init_info": {
                    **trainer.info(), "backend": "gloo"}})  # fmt: skip
                assert r.status_code == 200, r.text
                params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
                stream = backend.requests.engine.generate(prompts()[0], params, "inflight")
                first = await anext(stream)  # in flight when the pause comes
                assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
                assert (await http.post("/start_weight_update", json={})).status_code == 200
                trainer.send()
                info = {"names": names, **meta, "packed": True, "packed_buffer_size_bytes": 3000}
                r = await http.post("/update_weights", json={"update_info": info})
                assert r.status_code == 200, r.text
                r = await http.post("/finish_weight_update", json={"weight_version": "step-42"})
                assert r.status_code == 200, r.text
                assert (await http.post("/resume")).status_code == 200
                async for last in stream:
                    pass
            finally:
                trainer.close()
            versions = last.outputs[0].weight_versions
            assert first.weight_version == 0 and versions[0] == 0 and versions[-1] == 1
            assert versions == sorted(versions)  # 0..0 then 1..1
            assert await versions_everywhere(http) == everywhere_as("step-42")
            got = await outputs(backend)
            assert [ids for ids, _ in got] == [hf_greedy(v1_dir, p, 6)[0] for p in prompts()]
            assert all(versions == {1} for _, versions in got)

            trainer = Trainer(tiny_llama_dir, specs)  # SGLang: back to the first weights, as v2
            try:
                await http.post("/pause_generation", json={"mode": "abort"})
                r = await http.post("/init_weights_update_group", json=trainer.info())
                assert r.status_code == 200, r.text
                trainer.send()
                half = len(names) // 2  # slime's buckets: one pause, the same weight_version
                for part in (slice(None, half), slice(half, None)):
                    r = await http.post("/update_weights_from_distributed", json={
                        "names": names[part], "dtypes": meta["dtype_names"][part],
                        "shapes": meta["shapes"][part], "group_name": GROUP,
                        "weight_version": "7"})  # fmt: skip
                    assert r.status_code == 200, r.text
                    # committed at /continue_generation, on every replica at once
                    version = (await http.get("/get_weight_version")).json()["weight_version"]
                    assert version == "step-42"
                await http.post("/continue_generation", json={})
                assert (await http.post("/destroy_weights_update_group", json={})).json()["success"]
            finally:
                trainer.close()
            assert await versions_everywhere(http) == everywhere_as("7")  # raylane's 2
            r = await http.post("/update_weights_from_distributed", json={  # no group any more
                "names": names, "dtypes": meta["dtype_names"], "shapes": meta["shapes"],
                "weight_version": "3"})  # fmt: skip
            assert r.status_code == 400 and "group_name" in r.json()["error"]["message"]
            assert (await http.get("/is_paused")).json() == {"is_paused": False}  # not left so
            assert (await http.get("/get_weight_version")).json()["weight_version"] == "7"
        got = await outputs(backend)
        assert [ids for ids, _ in got] == [hf_greedy(tiny_llama_dir, p, 6)[0] for p in prompts()]
        assert all(versions == {2} for _, versions in got)
        assert answer_problems(app, answers) == []

    with_backend(tiny_llama_dir, test)
