"""`RolloutClient` over HTTP against the real app (tiny Llama, `local_backend`, an admin key):
generation against the offline engine, admin auth, weight updates against HF on the new
weights, abort, pause, sessions, and fan-out against a sequential run (engine steps, tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch
from raylane.actors.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from raylane.client import BadRequest, RolloutClient, Unauthorized
from raylane.session_server.app import build_app
from raylane.session_server.backend import Backend, local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread

USER_KEY = "sk-user"
ADMIN_KEY = "sk-admin"
PROMPT = [5, 17, 42, 99, 7, 150, 33]


@pytest.fixture(scope="module")
def local(tiny_llama_dir) -> Backend:
    """The served engine (its own: tests here change its weights and pause it)."""
    return local_backend(AsyncLLMEngine(LLMEngine(tiny_config(tiny_llama_dir))), "tiny")


@pytest.fixture(scope="module")
def url(local) -> Iterator[str]:
    app = build_app(local, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=1 << 20)
    with ServerThread(app) as srv:
        yield srv.url


@pytest.fixture
async def client(url):
    async with RolloutClient(url, api_key=USER_KEY, admin_key=ADMIN_KEY) as c:
        yield c


def counters(local: Backend) -> dict:
    return dict(local.requests.engine.stats_snapshot()["counters"])


def offline(ref_engine, prompt, **params):
    return ref_engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def kv_idle(local: Backend) -> bool:
    bm = local.requests.engine.engine.block_manager
    return not local.requests.engine.engine.requests and bm.num_free_blocks == bm.num_blocks


# --- generation -------------------------------------------------------------------------------


async def test_generate_ids_equals_the_offline_engine(client, ref_engine):
    want = offline(
        ref_engine, PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0
    ).outputs[0]
    (got,) = await client.generate(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got.prompt_token_ids == PROMPT and got.finish_reason == "length"
    assert got.weight_versions == [0] * 8 and got.request_id.startswith("rl-")


async def test_generate_text_and_seeded_samples(client, ref_engine, local):
    text = "The capital of France"
    want = offline(ref_engine, text, temperature=0.0, max_tokens=4, ignore_eos=True)
    (got,) = await client.generate(text, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert got.prompt_token_ids == local.tokenizer.encode(text)
    assert got.token_ids == want.outputs[0].token_ids
    first = await client.generate(PROMPT, n=3, seed=7, max_tokens=6, ignore_eos=True)
    again = await client.generate(PROMPT, n=3, seed=7, max_tokens=6, ignore_eos=True)
    assert [r.index for r in first] == [0, 1, 2]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


async def test_bad_input_is_a_value_error(client):
    with pytest.raises(ValueError, match="max_tokenz"):
        await client.generate(PROMPT, max_tokenz=3)  # refused before sending
    with pytest.raises(BadRequest, match="max_new_tokens"):
        await client.generate(PROMPT, max_tokens=10_000)  # refused by the server


# --- admin ------------------------------------------------------------------------------------


async def test_admin_calls_need_the_admin_key(url):
    async with RolloutClient(url, api_key=USER_KEY, admin_key=USER_KEY) as user:
        with pytest.raises(Unauthorized) as e:
            await user.pause("keep")
        assert e.value.status == 403
    async with RolloutClient(url, api_key=USER_KEY) as anonymous:
        with pytest.raises(Unauthorized) as e:
            await anonymous.weight_version()
        assert e.value.status == 401


async def test_update_weights_then_outputs_follow_the_new_weights(client, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    start = await client.weight_version()
    try:
        assert (
            await client.update_weights(model.named_parameters(), start + 1, bucket_bytes=64 << 10)
            == start + 1
        )
        assert await client.weight_version() == start + 1
        (got,) = await client.generate(PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True)
        want = model.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
        assert got.token_ids == want and got.weight_versions == [start + 1] * 6
    finally:  # back to the checkpoint's weights, for the other tests
        await client.update_weights(original.items(), start + 2)


async def test_a_bad_update_changes_nothing(client, tiny_llama_dir, ref_engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    named = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()]
    name, tensor = named[1]
    named[1] = (name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))
    version = await client.weight_version()
    with pytest.raises(BadRequest, match="shape"):
        await client.update_weights(named, version + 1)
    assert await client.weight_version() == version
    want = offline(ref_engine, PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True)
    (got,) = await client.generate(PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert got.token_ids == want.outputs[0].token_ids  # not paused, weights unchanged


async def test_abort_returns_partial_outputs_and_frees_blocks(client, local):
    rid = "abort-me"
    before = counters(local)["generation_tokens"]
    running = asyncio.ensure_future(
        client.generate(PROMPT, request_id=rid, max_tokens=200, ignore_eos=True, temperature=0.0)
    )
    await until(lambda: counters(local)["generation_tokens"] >= before + 3)
    (partial,) = await client.abort([rid])
    assert partial.finish_reason == "abort" and 3 <= len(partial.token_ids) < 200
    (ended,) = await running
    assert ended.finish_reason == "abort" and ended.token_ids == partial.token_ids
    await until(lambda: kv_idle(local))


async def test_pause_keep_freezes_then_resume_finishes(client, local, ref_engine):
    want = offline(ref_engine, PROMPT, temperature=0.0, max_tokens=40, ignore_eos=True)
    before = counters(local)["generation_tokens"]
    running = asyncio.ensure_future(
        client.generate(PROMPT, max_tokens=40, ignore_eos=True, temperature=0.0)
    )
    await until(lambda: counters(local)["generation_tokens"] >= before + 2)
    await client.pause("keep")
    frozen = counters(local)["generation_tokens"]
    await asyncio.sleep(0.2)
    assert counters(local)["generation_tokens"] == frozen and not running.done()
    await client.resume()
    (got,) = await asyncio.wait_for(running, 30)
    assert got.token_ids == want.outputs[0].token_ids


# --- sessions ---------------------------------------------------------------------------------


async def test_session_turns_merge_into_a_training_sample(client):
    async with await client.session({"task": "t1"}) as session:
        messages = [{"role": "user", "content": "Hello, world!"}]
        first = await session.chat(messages, max_tokens=5, temperature=0.0)
        messages += [first.message, {"role": "user", "content": "How are you today?"}]
        second = await session.chat(messages, max_tokens=5, temperature=0.0)
        sample = await session.sample()
        assert (await session.describe())["num_turns"] == 2
    generated = first.token_ids + second.token_ids
    assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == generated
    kept = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if m]
    assert kept == pytest.approx(first.logprobs + second.logprobs, abs=1e-5)
    assert sample.weight_versions == [first.weight_version, second.weight_version]


# --- fan-out ----------------------------------------------------------------------------------

PREFIX = [(7 * i) % 200 + 3 for i in range(48)]  # three full KV blocks
SUFFIXES = [[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]]


async def test_fork_equals_sequential_in_fewer_steps(client, local):
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    await client.flush_cache()
    start = counters(local)
    branches = await client.fork(PREFIX, len(SUFFIXES), suffixes=SUFFIXES, **sampling)
    fanned = await client.gather(branches)
    mid = counters(local)
    await client.flush_cache()  # the sequential run starts as cold as the fan-out did
    after_flush = counters(local)
    sequential = [(await client.generate(PREFIX + s, **sampling))[0] for s in SUFFIXES]
    end = counters(local)

    assert [r.token_ids for r in fanned] == [r.token_ids for r in sequential]
    fan = {k: mid[k] - start[k] for k in start}
    seq = {k: end[k] - after_flush[k] for k in end}
    computed = {
        name: c["prompt_tokens"] - c["prefix_cache_hits"]
        for name, c in (("fan", fan), ("seq", seq))
    }
    print(
        f"\nfan-out: {fan['steps']} steps, {computed['fan']} prompt tokens computed, "
        f"{fan['generation_tokens']} generated; sequential: {seq['steps']} steps, "
        f"{computed['seq']} computed, {seq['generation_tokens']} generated"
    )
    assert computed["fan"] <= computed["seq"]  # the prefix was computed once in both
    assert fan["generation_tokens"] == seq["generation_tokens"] + 1  # + the warm-up token

    # how many steps they share depends on when their HTTP requests arrive; branches that
    # arrive together (held by a pause, then resumed) run in one batch: 1 + 7 steps, not 4 * 8
    await client.pause("keep")
    before = counters(local)
    held = await client.fork(PREFIX, len(SUFFIXES), suffixes=SUFFIXES, warm=False, **sampling)
    await until(lambda: local.requests.engine.num_requests == len(SUFFIXES))
    await client.resume()
    together = await client.gather(held)
    batched = {k: v - before[k] for k, v in counters(local).items()}
    assert [r.token_ids for r in together] == [r.token_ids for r in sequential]
    print(f"held then resumed together: {batched['steps']} steps")
    assert batched["steps"] * 2 <= seq["steps"]
    await until(lambda: kv_idle(local))


async def test_release_frees_a_branch_and_gather_takes_the_rest(client, local):
    branches = await client.fork(
        PREFIX, 3, suffixes=SUFFIXES[:3], temperature=0.0, max_tokens=150, ignore_eos=True
    )
    await until(lambda: len(local.requests.engine.engine.requests) == 3)
    await client.release(branches[2])
    assert branches[2].request_id not in local.requests.engine.engine.requests
    rest = await client.gather(branches[:2])
    assert all(r.finish_reason == "length" and len(r.token_ids) == 150 for r in rest)
    await until(lambda: kv_idle(local))


async def test_gather_fail_fast_aborts_the_siblings(client, local):
    too_long = [3] * 300  # past the 256-token context: this branch fails at the server
    branches = await client.fork(
        PREFIX,
        3,
        suffixes=[[5], [6], too_long],
        warm=False,
        temperature=0.0,
        max_tokens=200,
        ignore_eos=True,
    )
    with pytest.raises(BadRequest):
        await client.gather(branches)
    assert all(b.done() for b in branches)
    await until(lambda: kv_idle(local))  # the siblings were aborted, not left to run


async def test_graph_of_thought_example_equals_its_sequential_version(client, local):
    """The example's propose -> score -> aggregate, against the same prompts and seeds run one
    after another: the same proposals and answer, in fewer engine steps."""
    from raylane.examples import graph_of_thought as got

    question, k, max_tokens = "How many legs do 3 spiders have?", 3, 12
    await client.flush_cache()
    start = counters(local)
    proposals = await got.propose(client, question, k, keep=k, max_tokens=max_tokens, seed=5)
    best = client.aggregate(proposals, 2, score=got.confidence)
    final = await got.aggregate_answer(client, question, best, max_tokens)
    mid = counters(local)

    await client.flush_cache()
    after_flush = counters(local)
    prefix = await client.tokenize(
        messages=[
            {"role": "system", "content": "You solve problems carefully and state the answer."},
            {"role": "user", "content": question},
        ]
    )
    one_by_one = []
    for i, approach in enumerate(got.APPROACHES[:k]):
        suffix = await got._ids(client, " " + approach)
        (r,) = await client.generate(
            prefix + suffix, temperature=0.7, seed=5 + i, max_tokens=max_tokens
        )
        one_by_one.append(r)
    ranked = sorted(one_by_one, key=got.confidence, reverse=True)[:2]
    drafts = "\n\n".join(f"Draft {i + 1}:\n{r.text.strip()}" for i, r in enumerate(ranked))
    (answer,) = await client.generate(
        await client.tokenize(
            messages=[
                {
                    "role": "user",
                    "content": (
                        f"{question}\n\nHere are draft solutions:\n\n{drafts}\n\n"
                        "Combine the drafts into one short, correct final answer."
                    ),
                }
            ]
        ),
        temperature=0.0,
        max_tokens=max_tokens,
    )
    end = counters(local)

    assert [r.token_ids for r in proposals] == [r.token_ids for r in one_by_one]
    assert [r.token_ids for r in best] == [r.token_ids for r in ranked]
    assert final.token_ids == answer.token_ids
    fan = {c: mid[c] - start[c] for c in start}
    seq = {c: end[c] - after_flush[c] for c in end}
    assert fan["generation_tokens"] == seq["generation_tokens"] + 1  # + fork's warm-up token
    assert fan["steps"] < seq["steps"]  # the branches decoded in the same steps
    with pytest.raises(ValueError):
        client.aggregate(proposals, k + 1)
