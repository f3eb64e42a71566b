"""The rollout client's pure parts against a fake transport: weight buckets, Rollout
conversion (engine output and /generate JSON agree), the /generate body, retries, fan-out."""

from __future__ import annotations

import asyncio
import base64
import math

import numpy as np
import pytest
import torch
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.actors.models.weights import TensorSpec, bucket_specs, decode_bucket
from raylane.client import Busy, RolloutClient, aggregate
from raylane.client.rollout import Rollout, from_generate_item, from_request_output
from raylane.client.wire import generate_body, sampling_params


class FakeTransport:
    """Records every call; `generate` answers after `delay` seconds (per prompt, if a dict)."""

    can_abort = True

    def __init__(self, delay: float | dict = 0.0, fail: dict | None = None, busy: int = 0):
        self.calls: list[tuple] = []
        self.delay = delay
        self.fail = fail or {}  # prompt tuple -> exception
        self.busy = busy  # answer Busy this many times first
        self.staged_live = 0
        self.max_staged_live = 0
        self.cancelled: list[str] = []

    async def generate(self, prompt, params, request_id, routing_key):
        self.calls.append(("generate", tuple(prompt), params, request_id, routing_key))
        if self.busy:
            self.busy -= 1
            raise Busy(429, "busy")
        delay = self.delay.get(tuple(prompt), 0.0) if isinstance(self.delay, dict) else self.delay
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        if tuple(prompt) in self.fail:
            raise self.fail[tuple(prompt)]
        ids = [len(prompt), params.seed or 0]
        return [Rollout(request_id, 0, list(prompt), ids, "", "length", [0.0, 0.0], [0, 0])]

    async def abort(self, request_ids):
        self.calls.append(("abort", list(request_ids)))
        return []

    async def begin_update(self, version, spec_dicts):
        self.calls.append(("begin", version, spec_dicts))
        return "u1"

    def stage_bucket(self, payload):
        self.staged_live += 1
        self.max_staged_live = max(self.max_staged_live, self.staged_live)
        return payload.tobytes()  # staging copies the bucket out, as the real ones do

    async def load_bucket(self, update_id, staged):
        await asyncio.sleep(0.01)
        self.calls.append(("bucket", update_id, staged))
        self.staged_live -= 1
        return len(decode_bucket(staged))

    async def commit_update(self, update_id):
        self.calls.append(("commit", update_id))
        return 1

    async def close(self):
        pass


def _named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.weight", torch.randn(n, generator=gen)) for i, n in enumerate(sizes)]


# --- weight updates ---------------------------------------------------------------------------


async def test_update_weights_sends_manifest_then_bounded_buckets_then_commit():
    fake = FakeTransport()
    named = _named([100, 100, 300, 50, 50, 50])  # float32: 400, 400, 1200, 200, 200, 200 bytes
    version = await RolloutClient(transport=fake).update_weights(named, 1, bucket_bytes=800)
    kinds = [c[0] for c in fake.calls]
    assert version == 1
    assert kinds[0] == "begin" and kinds[-1] == "commit" and set(kinds[1:-1]) == {"bucket"}
    assert fake.calls[0][2] == [TensorSpec.of(n, t).to_dict() for n, t in named]
    buckets = [decode_bucket(c[2]) for c in fake.calls[1:-1]]
    assert [sorted(b) for b in buckets] == [
        ["layers.0.weight", "layers.1.weight"],
        ["layers.2.weight"],  # too big: alone
        ["layers.3.weight", "layers.4.weight", "layers.5.weight"],
    ]
    sent = {name: t for b in buckets for name, t in b.items()}
    assert all(torch.equal(sent[n], t) for n, t in named)
    assert fake.max_staged_live <= 2  # one travelling, one encoded ahead


async def test_update_weights_buckets_are_safetensors_in_hf_names():
    fake = FakeTransport()
    model = torch.nn.Linear(4, 3)
    await RolloutClient(transport=fake).update_weights(model.named_parameters(), 2)
    (payload,) = [c[2] for c in fake.calls if c[0] == "bucket"]
    assert payload[:8] != b"\x80\x04\x95"[:8]  # not a pickle
    assert sorted(s.name for s in bucket_specs(payload)) == ["bias", "weight"]


async def test_update_weights_needs_tensors():
    with pytest.raises(ValueError, match="no tensors"):
        await RolloutClient(transport=FakeTransport()).update_weights([], 1)


# --- Rollout conversion -----------------------------------------------------------------------


def _engine_output() -> RequestOutput:
    experts = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    c = CompletionOutput(
        0,
        "hi",
        [7, 8],
        logprobs=[-0.5, -math.inf],
        top_logprobs=[{7: -0.5}, {8: -math.inf}],
        finish_reason="length",
        routed_experts=experts,
        weight_versions=[0, 1],
        kept_mass_logprobs=[-0.1, 0.0],
    )
    return RequestOutput("r1", None, [1, 2, 3], [c], True, num_cached_tokens=2, weight_version=1)


def _generate_item(out: RequestOutput) -> dict:
    """The /generate answer item for `out`, as session_server/native_format.py writes it."""
    c = out.outputs[0]
    data = base64.b64encode(c.routed_experts.astype("<i4").tobytes()).decode()
    floor = [max(lp, -9999.0) for lp in c.logprobs]
    return {
        "text": c.text,
        "output_ids": c.token_ids,
        "meta_info": {
            "id": out.request_id,
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 2,
            "weight_version": 1,
            "weight_versions": c.weight_versions,
            "kept_mass_logprobs": c.kept_mass_logprobs,
            "routed_experts": {"data": data, "shape": list(c.routed_experts.shape)},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(floor, c.token_ids)],
            "output_top_logprobs": [[[lp, t, None]] for lp, t in zip(floor, c.token_ids)],
        },
    }


def test_rollout_from_engine_output_and_from_http_agree():
    out = _engine_output()
    (a,) = from_request_output(out)
    b = from_generate_item(_generate_item(out), [1, 2, 3], "r1")
    for r in (a, b):
        assert r.token_ids == [7, 8] and r.prompt_token_ids == [1, 2, 3]
        assert r.logprobs == [-0.5, -math.inf]  # the JSON floor becomes -inf again
        assert r.top_logprobs == [{7: -0.5}, {8: -math.inf}]
        assert r.weight_versions == [0, 1] and r.weight_version == 1
        assert r.kept_mass_logprobs == [-0.1, 0.0]
        assert r.finish_reason == "length" and r.request_id == "r1" and r.num_cached_tokens == 2
        assert r.routed_experts.dtype == np.int32
        np.testing.assert_array_equal(r.routed_experts, out.outputs[0].routed_experts)
        assert type(r.token_ids[0]) is int and type(r.logprobs[0]) is float


def test_rollout_without_optional_fields():
    item = {
        "text": "",
        "output_ids": [5],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "abort", "message": "m"},
            "weight_version": 3,
            "weight_versions": [3],
            "routed_experts": None,
        },
    }
    r = from_generate_item(item)
    assert r.finish_reason == "abort" and r.logprobs is None and r.routed_experts is None
    assert r.kept_mass_logprobs is None and r.weight_versions == [3] and r.prompt_token_ids == []


def test_rollout_keeps_the_integer_when_the_answer_carries_a_label():
    """With the trainer API on, `weight_version` is the trainer's label ("7" for raylane's 2):
    the rollout's version is raylane's integer, that of its last token."""
    for label in ("step-42", "7"):
        meta = {"weight_version": label, "weight_versions": [1, 2], "finish_reason": None}
        r = from_generate_item({"output_ids": [5, 6], "meta_info": meta})
        assert r.weight_version == 2 and r.weight_versions == [1, 2]


# --- the /generate body -----------------------------------------------------------------------


def test_generate_body_renames_sampling_fields():
    params = sampling_params(
        {
            "max_tokens": 5,
            "min_tokens": 1,
            "temperature": 0.5,
            "seed": 3,
            "include_stop_str_in_output": True,
            "logprobs": 2,
            "n": 2,
            "return_routed_experts": True,
        }
    )
    body = generate_body([1, 2], params, "rid", "key")
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 5 and sp["min_new_tokens"] == 1 and sp["no_stop_trim"]
    assert sp["temperature"] == 0.5 and sp["seed"] == 3 and sp["n"] == 2
    assert "max_weight_lag" not in sp and "return_kept_mass" not in sp  # unset: not sent
    assert body["return_logprob"] and body["top_logprobs_num"] == 2
    assert body["return_routed_experts"] and body["rid"] == "rid" and body["routing_key"] == "key"
    assert body["input_ids"] == [1, 2]
    rl = generate_body(
        [1], sampling_params({"max_weight_lag": 1, "return_kept_mass": True}), "r", None
    )["sampling_params"]
    assert rl["max_weight_lag"] == 1 and rl["return_kept_mass"] is True


def test_logprobs_by_default_and_bad_fields_fail_before_sending():
    assert sampling_params({}).logprobs == 0
    assert sampling_params({"logprobs": None}).logprobs is None
    with pytest.raises(ValueError, match="max_tokenz"):
        sampling_params({"max_tokenz": 3})
    with pytest.raises(ValueError, match="top_p"):
        sampling_params({"top_p": 2.0})
    with pytest.raises(ValueError, match="prompt_logprobs"):
        generate_body([1], sampling_params({"prompt_logprobs": 1}), "r", None)


async def test_generate_rejects_bad_fields_without_calling():
    fake = FakeTransport()
    with pytest.raises(ValueError):
        await RolloutClient(transport=fake).generate([1], temperature=-1)
    assert fake.calls == []


# --- retries and timeouts ---------------------------------------------------------------------


async def test_busy_is_retried_then_raised():
    fake = FakeTransport(busy=2)
    outs = await RolloutClient(transport=fake).generate([1, 2])
    assert outs[0].token_ids == [2, 0] and len(fake.calls) == 3
    with pytest.raises(Busy):
        await RolloutClient(transport=FakeTransport(busy=100), busy_timeout_s=0.2).generate([1])


async def test_timeout_cancels_the_request():
    fake = FakeTransport(delay=5.0)
    with pytest.raises(asyncio.TimeoutError):
        await RolloutClient(transport=fake).generate([1], timeout=0.05)
    assert len(fake.cancelled) == 1


# --- fan-out ----------------------------------------------------------------------------------


async def test_fork_warms_the_prefix_then_starts_branches_together():
    fake = FakeTransport()
    client = RolloutClient(transport=fake)
    branches = await client.fork([1, 2, 3], 3, suffixes=[[10], [11], [12]], seed=5, max_tokens=4)
    results = await client.gather(branches)
    warm, *runs = [c for c in fake.calls if c[0] == "generate"]
    assert warm[1] == (1, 2, 3) and warm[2].max_tokens == 1
    assert [r[1] for r in runs] == [(1, 2, 3, 10), (1, 2, 3, 11), (1, 2, 3, 12)]
    assert {r[4] for r in runs} == {warm[4]}  # one routing key: one replica
    assert [r.token_ids for r in results] == [[4, 5], [4, 6], [4, 7]]  # seeds 5, 6, 7
    assert [b.request_id for b in branches] == [r[3] for r in runs]


async def test_fork_checks_its_arguments():
    client = RolloutClient(transport=FakeTransport())
    with pytest.raises(ValueError, match="suffixes"):
        await client.fork([1], 2, suffixes=[[2]])
    with pytest.raises(ValueError, match="k must"):
        await client.fork([1], 0)
    with pytest.raises(ValueError, match="n=1"):
        await client.fork([1], 2, n=2)
    with pytest.raises(ValueError, match="text suffixes"):
        await client.fork("abc", 1, suffixes=[[1]])


async def test_gather_fail_fast_releases_the_siblings():
    fake = FakeTransport(
        delay={(1, 5): 10.0, (1, 6): 10.0}, fail={(1, 7): RuntimeError("replica died")}
    )
    client = RolloutClient(transport=fake)
    branches = await client.fork([1], 3, suffixes=[[5], [6], [7]], warm=False)
    with pytest.raises(RuntimeError, match="replica died"):
        await asyncio.wait_for(client.gather(branches), 5)
    slow = {branches[0].request_id, branches[1].request_id}
    assert set(fake.cancelled) == slow
    aborted = {rid for c in fake.calls if c[0] == "abort" for rid in c[1]}
    assert aborted == slow
    assert all(b.done() for b in branches)


async def test_gather_without_fail_fast_keeps_errors_in_place():
    fake = FakeTransport(fail={(1, 6): RuntimeError("x")})
    client = RolloutClient(transport=fake)
    branches = await client.fork([1], 2, suffixes=[[5], [6]], warm=False)
    ok, err = await client.gather(branches, fail_fast=False)
    assert ok.token_ids == [2, 0] and isinstance(err, RuntimeError)


async def test_release_stops_a_branch_at_once():
    fake = FakeTransport(delay=10.0)
    client = RolloutClient(transport=fake)
    (branch,) = await client.fork([1], 1, warm=False)
    await asyncio.sleep(0)
    await asyncio.wait_for(client.release(branch), 1)
    assert branch.done() and branch.released
    assert fake.cancelled == [branch.request_id]
    assert ("abort", [branch.request_id]) in fake.calls
    with pytest.raises(asyncio.CancelledError):
        await branch.result()
    with pytest.raises(ValueError, match="released"):
        await client.gather([branch])


def test_aggregate_picks_the_k_best_and_refuses_more_than_there_are():
    proposals = ["a", "bbb", "cc"]
    assert aggregate(proposals, 2, score=len) == ["bbb", "cc"]
    assert aggregate(proposals, 3) == proposals
    assert RolloutClient.aggregate(proposals, 1, score=len) == ["bbb"]
    with pytest.raises(ValueError, match="only 3"):
        aggregate(proposals, 4)
    with pytest.raises(ValueError, match="only 0"):
        aggregate([], 1)
    with pytest.raises(ValueError, match="positive"):
        aggregate(proposals, 0)
