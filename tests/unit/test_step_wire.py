"""The step channel's wire: plans and results round-trip, nothing else unpickles, and a shard
serves only the engine that holds its token (no Ray: a ModelShard object in this process)."""

from __future__ import annotations

import os
import pickle
import socket
import threading

import numpy as np
import pytest
import torch
from raylane.actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from raylane.actors.runner import wire
from raylane.actors.runner.config import RunnerConfig
from raylane.actors.runner.plan import (
    CachedRequest,
    ChannelCommand,
    NewRequest,
    StepError,
    StepPlan,
    StepResult,
)
from raylane.actors.shard import LOOPBACK, ModelShard


def a_plan() -> StepPlan:
    # the user's SamplingParams travel as they are, structured outputs included
    params = SamplingParams(
        seed=3, stop_token_ids=[2], stop="x", structured_outputs=StructuredOutputsParams(regex="a+")
    )
    new = NewRequest(7, 1, (5, 6, 7), (3, 4), 0, params)
    cached = CachedRequest(9, (11,), (8,), 16, resumed=True)
    return StepPlan(4, (new,), (cached,), ((7, 3), (9, 1)), 1, (1, 2), (9,))


def test_plans_and_results_round_trip():
    plan = a_plan()
    assert wire.decode(wire.encode(plan)) == plan
    result = StepResult.empty(2)
    result.token_ids[0], result.top_logprobs[0] = 42, {42: -0.25, 7: -1.5}
    result.routed_experts[1] = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    back = wire.decode(wire.encode(result))
    assert back.token_ids == [42, None] and back.top_logprobs[0] == {42: -0.25, 7: -1.5}
    assert back.routed_experts[1].dtype == np.int32
    assert np.array_equal(back.routed_experts[1], result.routed_experts[1])
    # speculative decoding: drafts (placeholders: the runner's draft model draws them), and
    # the drafts it drew, back
    spec = wire.decode(wire.encode(StepPlan(5, draft_token_ids=((7, (1, 2)), (8, (-1, -1))))))
    assert spec.draft_token_ids == ((7, (1, 2)), (8, (-1, -1)))
    result.drafts = [(3, 4), None]
    assert wire.decode(wire.encode(result)).drafts == [(3, 4), None]


@pytest.mark.parametrize("payload", [os.system, pickle.loads, torch.ones, {"x": eval}])
def test_anything_but_plan_types_is_refused(payload):
    with pytest.raises(wire.WireError, match="refusing"):
        wire.decode(pickle.dumps(payload))


def test_garbage_is_a_wire_error():
    with pytest.raises(wire.WireError):
        wire.decode(b"not a pickle")


@pytest.fixture
def shard():
    # no runner is loaded: a step fails, which is enough to see how the channel answers
    config = RunnerConfig(model_dir="unused")
    return ModelShard(config, rank=0, world_size=1, torch_threads=torch.get_num_threads())


def serve(shard: ModelShard) -> tuple[int, bytes, list[str]]:
    """Open the channel and serve it on a thread, as the shard's main thread would."""
    port, token = shard.open_step_channel()
    ended: list[str] = []
    threading.Thread(target=lambda: ended.append(shard.serve_steps()), daemon=True).start()
    return port, token, ended


def connect(port: int, token: bytes) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=10)
    sock.sendall(token)
    return sock


def ask(sock: socket.socket, message: object) -> object:
    wire.send_frame(sock, wire.encode(message))
    return wire.decode(wire.recv_frame(sock))


def test_a_wrong_token_is_hung_up_on_and_the_right_one_is_served(shard):
    port, token, ended = serve(shard)
    with connect(port, bytes(len(token))) as intruder:
        wire.send_frame(intruder, wire.encode(a_plan()))
        with pytest.raises(wire.WireError, match="closed"):
            wire.recv_frame(intruder)
    with connect(port, token) as engine:
        # the step itself fails (no model loaded): the error comes back as a reply, not a hang;
        # one rank alone serves on, so it is a StepError (a group's rank says RuntimeError)
        reply = ask(engine, a_plan())
        assert isinstance(reply, StepError) and "not started" in reply.message
        assert ask(engine, ChannelCommand("ping")) == 0  # the rank
        assert ask(engine, ChannelCommand("release")) is None
        wait_for(lambda: ended == ["released"])
        # served again on the same connection (as after a weight load between steps)
        threading.Thread(target=lambda: ended.append(shard.serve_steps()), daemon=True).start()
        assert ask(engine, ChannelCommand("ping")) == 0
    wait_for(lambda: ended == ["released", "closed"])  # the engine hung up


def test_a_frame_that_is_not_a_plan_ends_the_channel(shard):
    port, token, ended = serve(shard)
    with connect(port, token) as engine:
        wire.send_frame(engine, pickle.dumps(os.system))
        with pytest.raises(wire.WireError, match="closed"):
            wire.recv_frame(engine)
    wait_for(lambda: ended == ["closed"])


def wait_for(check, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
