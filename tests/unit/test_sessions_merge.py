"""Merging turn records into one training sample, and its serialisations."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams
from raylane.router.errors import MalformedTrajectory
from raylane.router.samples import TrainingSample, merge_trajectory
from raylane.router.trajectory import TurnRecord

from tests.support.fake_generator import token_routing


def record(
    prefix_len: int,
    prompt: list[int],
    output: list[int],
    finish: str = "stop",
    version: int = 0,
    blob: bool = True,
) -> TurnRecord:
    end = prefix_len + len(prompt) + len(output)
    # the engine's blob covers the whole prefix; here a function of position, any shape [end-1,..]
    experts = token_routing(list(range(end))) if blob else None
    return TurnRecord(
        new_messages=[],
        reply={"role": "assistant", "content": ""},
        params=SamplingParams(),
        prefix_len=prefix_len,
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-0.5 - i for i in range(len(output))],
        finish_reason=finish,
        weight_version=version,
        routed_experts=experts,
    )


def three_turns(last_finish: str = "stop") -> list[TurnRecord]:
    a = record(0, [1, 2, 3], [10, 11], version=1)
    b = record(a.end, [4, 5], [12, 13, 14], version=1)
    c = record(b.end, [6], [15], finish=last_finish, version=2)
    return [a, b, c]


def test_merge_lays_turns_end_to_end():
    records = three_turns()
    s = merge_trajectory(records)
    assert s.tokens == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 6, 15]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert s.rollout_logprobs == [0.0] * 3 + [-0.5, -1.5] + [0.0] * 2 + [-0.5, -1.5, -2.5] + [
        0.0,
        -0.5,
    ]
    assert s.weight_versions == [1, 1, 2] and s.status == "completed"
    assert s.routed_experts.shape == (len(s.tokens) - 1, 2, 2)
    assert np.array_equal(s.routed_experts, records[-1].routed_experts)


@pytest.mark.parametrize("finish, status", [("length", "truncated"), ("abort", "aborted")])
def test_status_follows_the_last_turn(finish, status):
    assert merge_trajectory(three_turns(finish)).status == status


def test_max_seq_len_cuts_at_a_turn_boundary():
    records = three_turns()
    s = merge_trajectory(records, max_seq_len=len(merge_trajectory(records).tokens) - 1)
    assert s.tokens == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]  # the third turn does not fit
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert s.weight_versions == [1, 1] and s.status == "truncated"
    # the last turn's routing, cut to the kept positions
    assert np.array_equal(s.routed_experts, records[-1].routed_experts[: len(s.tokens) - 1])
    assert merge_trajectory(records, max_seq_len=100).status == "completed"


def test_no_blobs_give_no_routed_experts():
    records = [record(0, [1, 2], [3], blob=False)]
    assert merge_trajectory(records).routed_experts is None


def malformed_cases():
    gap = three_turns()
    gap[1].prefix_len += 1
    short_logprobs = three_turns()
    short_logprobs[1].logprobs.pop()
    dropped = three_turns()
    dropped[-1].drop_blobs()
    bad_shape = three_turns()
    bad_shape[-1].routed_experts = bad_shape[-1].routed_experts[:-1]
    return {
        "no turns": ([], None, "no turns"),
        "gap": (gap, None, "starts at token"),
        "logprobs": (short_logprobs, None, "logprobs"),
        "dropped": (dropped, None, "dropped"),
        "blob rows": (bad_shape, None, "one row per token"),
        "max_seq_len": (three_turns(), 4, "max_seq_len=4"),
    }


@pytest.mark.parametrize("name", list(malformed_cases()))
def test_malformed_trajectories_say_why(name):
    records, max_seq_len, reason = malformed_cases()[name]
    with pytest.raises(MalformedTrajectory, match=reason) as err:
        merge_trajectory(records, max_seq_len)
    assert err.value.status == 422


def test_safetensors_round_trip():
    s = merge_trajectory(three_turns())
    back = TrainingSample.from_safetensors(s.to_safetensors())
    assert back.tokens == s.tokens and back.loss_mask == s.loss_mask
    assert back.weight_versions == s.weight_versions and back.status == s.status
    assert np.allclose(back.rollout_logprobs, s.rollout_logprobs)
    assert back.routed_experts.dtype == np.int32
    assert np.array_equal(back.routed_experts, s.routed_experts)
    bare = merge_trajectory([record(0, [1, 2], [3], blob=False)])
    assert TrainingSample.from_safetensors(bare.to_safetensors()).routed_experts is None


def test_json_carries_routed_experts_as_base64_int32():
    s = merge_trajectory(three_turns())
    body = s.to_json()
    experts = body["routed_experts"]
    decoded = np.frombuffer(base64.b64decode(experts["data"]), dtype=np.int32)
    assert np.array_equal(decoded.reshape(experts["shape"]), s.routed_experts)
    assert body["tokens"] == s.tokens and body["status"] == "completed"
