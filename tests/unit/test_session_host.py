"""The Router's session hosting without Ray: the plain `Router` class, fake replica actor
handles, and the tiny tokenizer. Turns follow the routing policy and always give the replica
back; replica failures and full queues are clean session errors; errors survive pickling."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta
from raylane.router.actor import Router
from raylane.router.errors import (
    MalformedTrajectory,
    ReplicaFailed,
    ReplicasBusy,
    RollbackTooDeep,
    SessionNotFound,
)
from raylane.router.generator import RequestTurnGenerator
from raylane.router.replica_requests import ReplicaRequests
from raylane.router.session_host import SessionSetup
from raylane.serve_backend import RouterSessions

from tests.support.fake_generator import token_routing
from tests.tiny_models import make_tokenizer
from tests.unit.router_ingress import InProcessRouter

HELLO = [{"role": "user", "content": "hello"}]


class FakeStream:
    """A streaming call's response: async-iterable, cancellable."""

    def __init__(self, items) -> None:
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return _ready(await anext(self.items))  # as Ray streams: each item a ref to await

    def cancel(self) -> None:
        self.cancelled = True


async def _ready(value):
    return value


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_) -> Method:
        return self

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class ReplicaHandle:
    """One replica's actor handle, as `ReplicaChannels` uses it."""

    def __init__(self, fake: FakeHandle, replica_id: str) -> None:
        self.open_channel = Method(lambda channel_id: fake._open_channel(channel_id, replica_id))
        self.submit = Method(lambda *args: fake._submit(*args, replica_id))
        self.abort = Method(lambda ids: fake.aborted.extend(ids))


class FakeHandle:
    """The replicas' actor handles (`install` gives them to the Router): a replica's output
    channel (`open_channel`), `submit` (two output tokens per turn, each in its own batch),
    `abort`. `fail`: the channel's call fails after the first token (the replica died);
    `submit_error`: what submitting raises (as Ray wraps it)."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        self.aborted: list[str] = []
        self.fail: Exception | None = None
        self.submit_error: Exception | None = None
        self.channels: dict[str, asyncio.Queue] = {}

    def install(self, router: Router) -> None:
        for replica_id in router.policy.replicas:
            router.replica_set.handles[replica_id] = ReplicaHandle(self, replica_id)

    def _open_channel(self, channel_id: str, replica_id: str) -> FakeStream:
        queue = self.channels[channel_id] = asyncio.Queue()

        async def items():
            yield replica_id
            while True:
                batch = await queue.get()
                if isinstance(batch, Exception):
                    raise batch
                yield batch

        return FakeStream(items())

    async def _submit(self, prompt_ids, params, request_id, channel_id, replica_id):
        """`replica_id`: which replica's handle was called."""
        if self.submit_error is not None:
            raise self.submit_error
        self.targets.append(replica_id)
        ids = [5, 6]
        for n in (1, 2):  # deltas, as a replica sends them
            out = self._delta(prompt_ids, ids, n, params)
            self.channels[channel_id].put_nowait([(request_id, out)])
            if self.fail is not None:
                self.channels[channel_id].put_nowait(self.fail)
                return

    @staticmethod
    def _delta(prompt, ids, n, params) -> EngineCoreOutput:
        """What token n of `ids` adds (the prompt with the first)."""
        last = n == len(ids)
        experts = token_routing(prompt + ids) if last and params.return_routed_experts else None
        c = SampleDelta(
            0,
            "ab"[n - 1],
            ids[n - 1 : n],
            [-0.5],
            finish_reason="length" if last else None,
            routed_experts=experts,
        )
        return EngineCoreOutput("r", [c], last, prompt_token_ids=prompt if n == 1 else None)


@pytest.fixture(autouse=True)
def cancel_in_process(monkeypatch):
    import raylane.router.replica_channels as channels_module
    import raylane.serve_backend as backend_module

    monkeypatch.setattr(channels_module, "_cancel", lambda stream: stream.cancel())
    monkeypatch.setattr(backend_module, "_cancel", lambda call: call.cancel())


@pytest.fixture
def router() -> Router:
    router = Router(capacity=2)
    for replica_id in ("r1", "r2"):
        router.register(replica_id)
    router.sessions.load_tokenizer = lambda _: make_tokenizer()
    return router


def setup(handle: FakeHandle, model_dir: str = "tiny") -> SessionSetup:
    return SessionSetup(model_dir, return_routed_experts=True)


async def create(router: Router, handle: FakeHandle, metadata: dict | None = None) -> str:
    handle.install(router)
    return await router.session_create(setup(handle), metadata)


async def describe(router: Router, handle: FakeHandle, session_id: str) -> dict:
    return await router.session_describe(setup(handle), session_id)


def ingress(router: Router, handle: FakeHandle) -> RouterSessions:
    """The ingress's sessions: turns planned and committed by the Router, generated here on
    the replicas of the Router's own table (so its counts show the turns)."""
    requests = ReplicaRequests(router.sessions.view)
    generator = RequestTurnGenerator(requests, return_routed_experts=True)
    return RouterSessions(InProcessRouter(router), setup(handle), generator)


async def turn(router: Router, handle: FakeHandle, session_id: str, messages=HELLO) -> list:
    return [r async for r in ingress(router, handle).chat_stream(session_id, messages)]


async def test_turns_stick_to_the_policy_replica_and_give_it_back(router):
    handle = FakeHandle()
    session_id = await create(router, handle, {"run": 1})
    owner = router.policy.choose(session_id)  # the policy's pick, independent of the host
    messages = list(HELLO)
    for _ in range(3):
        results = await turn(router, handle, session_id, messages)
        messages += [results[-1].message, {"role": "tool", "content": "42"}]
    assert handle.targets == [owner] * 3
    view = router.sessions.view.policy.replicas  # where the Router's turns are counted
    counts = {rid: (r.routed, r.in_flight) for rid, r in view.items()}
    assert counts[owner] == (3, 0) and sum(routed for routed, _ in counts.values()) == 3
    assert all(r.output.routed_experts is None for r in results)  # not shipped to the ingress
    described = await describe(router, handle, session_id)
    record = described["records"][-1]
    assert described["metadata"] == {"run": 1}
    assert record["routed_experts_shape"] is not None  # the record keeps it
    sample = await router.session_sample(setup(handle), session_id, None)
    assert (
        sample.routed_experts.shape[0]
        == record["prefix_len"] + len(record["prompt_ids"]) + len(record["output_ids"]) - 1
    )


async def test_unknown_ids_are_404_before_and_after_creating(router):
    handle = FakeHandle()
    with pytest.raises(SessionNotFound):  # a fresh Router: the call builds the registry
        await describe(router, handle, "sess-nope")
    await create(router, handle)
    with pytest.raises(SessionNotFound):
        await router.session_delete(setup(handle), "sess-nope")


async def test_a_different_model_rebuilds_the_registry(router):
    first = await create(router, FakeHandle())
    again = await create(router, FakeHandle())  # same names: same registry
    await describe(router, FakeHandle(), first)
    other = setup(FakeHandle(), model_dir="other")
    await router.session_create(other, None)
    with pytest.raises(SessionNotFound):
        await router.session_describe(other, again)


async def test_a_failing_replica_is_a_503_reported_and_released(router):
    handle = FakeHandle()
    session_id = await create(router, handle)
    handle.fail = RuntimeError("replica died")
    with pytest.raises(ReplicaFailed) as err:
        await turn(router, handle, session_id)
    assert err.value.status == 503
    state = router.policy.replicas[handle.targets[0]]
    assert not state.healthy and state.in_flight == 0
    assert (await describe(router, handle, session_id))["num_turns"] == 0


async def test_a_replicas_bad_input_stays_a_value_error(router):
    handle = FakeHandle()
    session_id = await create(router, handle)
    wrapped = RuntimeError("RayTaskError")
    wrapped.cause = ValueError("prompt: too long")
    handle.submit_error = wrapped
    with pytest.raises(ValueError, match="prompt: too long"):
        await turn(router, handle, session_id)
    assert all(r["healthy"] for r in router.replicas())
    assert all(not r.in_flight for r in router.sessions.view.policy.replicas.values())


async def test_full_queues_are_429_and_no_replica_is_503(router):
    handle = FakeHandle()
    session_id = await create(router, handle)
    owner = router.policy.choose(session_id)
    router.heartbeat(owner, held=router.policy.capacity)  # its heartbeat: full
    with pytest.raises(ReplicasBusy) as err:
        await turn(router, handle, session_id)
    assert err.value.status == 429
    for replica_id in ("r1", "r2"):
        router.unregister(replica_id)
    with pytest.raises(ReplicaFailed):
        await turn(router, handle, session_id)


async def test_leaving_a_turn_early_cancels_the_replica_call(router):
    handle = FakeHandle()
    session_id = await create(router, handle)
    stream = ingress(router, handle).chat_stream(session_id, HELLO)
    await anext(stream)
    await stream.aclose()
    await asyncio.sleep(0.01)  # the Router's side unwinds (as after ray.cancel)
    assert len(handle.aborted) == 1 and handle.aborted[0].startswith(session_id)
    assert all(not r.in_flight for r in router.sessions.view.policy.replicas.values())
    assert (await describe(router, handle, session_id))["num_turns"] == 0


@pytest.mark.parametrize(
    "error",
    [
        SessionNotFound("sess-x"),
        RollbackTooDeep(2, 1),
        MalformedTrajectory("no turns", param="messages"),
    ],
)
def test_session_errors_survive_pickling(error):
    copy = pickle.loads(pickle.dumps(error))  # Ray ships them from the Router to the ingress
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.param == error.param and copy.status == error.status


async def test_a_turn_the_router_refuses_raises_before_anything_runs(router):
    handle = FakeHandle()
    await create(router, handle)
    with pytest.raises(SessionNotFound):
        await turn(router, handle, "sess-nope")
    assert handle.targets == [] and not router.sessions.handoff._waiting
