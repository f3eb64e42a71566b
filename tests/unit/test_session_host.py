"""The Router's session hosting without Ray: the plain `Router` class, a fake engine deployment
handle, and the tiny tokenizer. Turns follow the routing policy and always give the replica
back; replica failures and full queues are clean session errors; errors survive pickling."""

from __future__ import annotations

import pickle

import pytest

from actors.engine.output_delta import DeltaEncoder
from actors.engine.outputs import CompletionOutput, RequestOutput
from router.actor import Router
from router.errors import MalformedTrajectory, RollbackTooDeep, SessionNotFound
from router.fake_generator import token_routing
from router.replica_generator import NoReplica, ReplicasBusy
from router.session_host import SessionSetup
from tests.tiny_models import make_tokenizer

HELLO = [{"role": "user", "content": "hello"}]


class FakeStream:
    def __init__(self, outs: list[RequestOutput], fail: Exception | None) -> None:
        self.outs, self.fail, self.cancelled = outs, fail, False

    async def _items(self):
        for out in self.outs:
            yield out
            if self.fail is not None:
                raise self.fail

    def __aiter__(self):
        return self._items()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """`handle.options(stream=True).generate.remote(...)`: two output tokens per turn."""

    deployment_name = "EngineDeployment"

    def __init__(self, app_name: str = "raylane") -> None:
        self.app_name = app_name
        self.targets: list[str] = []
        self.streams: list[FakeStream] = []
        self.fail: Exception | None = None

    def options(self, **_) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, prompt_ids, params, request_id, target_replica=None) -> FakeStream:
        self.targets.append(target_replica)
        ids = [5, 6]
        outs = [self._out(prompt_ids, ids[:n], params, n == len(ids)) for n in (1, 2)]
        encoder = DeltaEncoder()  # as a replica streams them
        self.streams.append(FakeStream([encoder.encode(o) for o in outs], self.fail))
        return self.streams[-1]

    @staticmethod
    def _out(prompt, ids, params, last) -> RequestOutput:
        experts = token_routing(prompt + ids) if last and params.return_routed_experts else None
        c = CompletionOutput(0, "ab"[:len(ids)], ids, [-0.5] * len(ids),
                             finish_reason="length" if last else None, routed_experts=experts)
        return RequestOutput("r", None, prompt, [c], last)


@pytest.fixture
def router() -> Router:
    router = Router(capacity=2)
    for replica_id in ("r1", "r2"):
        router.register(replica_id)
    router.sessions.load_tokenizer = lambda _: make_tokenizer()
    return router


async def turn(router: Router, session_id: str, messages=HELLO) -> list:
    return [r async for r in router.chat_session(session_id, messages, None)]


def setup(handle: FakeHandle, model_dir: str = "tiny") -> SessionSetup:
    return SessionSetup(model_dir, handle, return_routed_experts=True)


async def test_turns_stick_to_the_policy_replica_and_give_it_back(router):
    handle = FakeHandle()
    session_id = await router.create_session(setup(handle), {"run": 1})
    owner = router.policy.choose(session_id)  # the policy's pick, independent of the host
    messages = list(HELLO)
    for _ in range(3):
        results = await turn(router, session_id, messages)
        messages += [results[-1].message, {"role": "tool", "content": "42"}]
    assert handle.targets == [owner] * 3
    counts = {r["replica_id"]: (r["routed"], r["in_flight"]) for r in router.replicas()}
    assert counts[owner] == (3, 0) and sum(routed for routed, _ in counts.values()) == 3
    assert all(r.output.routed_experts is None for r in results)  # not shipped to the ingress
    record = (await router.describe_session(session_id))["records"][-1]
    assert record["routed_experts_shape"] is not None  # the record keeps it
    sample = await router.sample_session(session_id)
    assert sample.routed_experts.shape[0] == record["prefix_len"] \
        + len(record["prompt_ids"]) + len(record["output_ids"]) - 1


async def test_unknown_ids_are_404_before_and_after_configuring(router):
    with pytest.raises(SessionNotFound):
        await router.describe_session("sess-nope")
    await router.create_session(setup(FakeHandle()))
    with pytest.raises(SessionNotFound):
        await router.delete_session("sess-nope")


async def test_a_different_model_rebuilds_the_registry(router):
    first = await router.create_session(setup(FakeHandle()))
    again = await router.create_session(setup(FakeHandle()))  # same names: same registry
    await router.describe_session(first)
    await router.create_session(setup(FakeHandle(), model_dir="other"))
    with pytest.raises(SessionNotFound):
        await router.describe_session(again)


async def test_a_failing_replica_is_a_503_reported_and_released(router):
    handle = FakeHandle()
    session_id = await router.create_session(setup(handle))
    handle.fail = RuntimeError("replica died")
    with pytest.raises(NoReplica) as err:
        await turn(router, session_id)
    assert err.value.status == 503
    state = router.policy.replicas[handle.targets[0]]
    assert not state.healthy and state.in_flight == 0
    assert (await router.describe_session(session_id))["num_turns"] == 0


async def test_a_replicas_bad_input_stays_a_value_error(router):
    handle = FakeHandle()
    session_id = await router.create_session(setup(handle))
    wrapped = RuntimeError("RayTaskError")
    wrapped.cause = ValueError("prompt: too long")
    handle.fail = wrapped
    with pytest.raises(ValueError, match="prompt: too long"):
        await turn(router, session_id)
    assert all(r["healthy"] and not r["in_flight"] for r in router.replicas())


async def test_full_queues_are_429_and_no_replica_is_503(router):
    session_id = await router.create_session(setup(FakeHandle()))
    owner = router.policy.choose(session_id)
    router.policy.replicas[owner].report(router.policy.capacity)  # its heartbeat: full
    with pytest.raises(ReplicasBusy) as err:
        await turn(router, session_id)
    assert err.value.status == 429
    for replica_id in ("r1", "r2"):
        router.unregister(replica_id)
    with pytest.raises(NoReplica):
        await turn(router, session_id)


async def test_leaving_a_turn_early_cancels_the_replica_call(router):
    handle = FakeHandle()
    session_id = await router.create_session(setup(handle))
    stream = router.chat_session(session_id, HELLO, None)
    await anext(stream)
    await stream.aclose()
    assert handle.streams[0].cancelled
    assert all(not r["in_flight"] for r in router.replicas())
    assert (await router.describe_session(session_id))["num_turns"] == 0


@pytest.mark.parametrize("error", [SessionNotFound("sess-x"), RollbackTooDeep(2, 1),
                                   MalformedTrajectory("no turns", param="messages")])
def test_session_errors_survive_pickling(error):
    copy = pickle.loads(pickle.dumps(error))  # Ray ships them from the Router to the ingress
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.param == error.param and copy.status == error.status
