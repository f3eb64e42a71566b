"""A session turn's deadline (`timeout_s`): past it the generation is aborted and the turn
commits its partial output, finish reason "abort", as a control-plane abort's turn is recorded;
the next turn carries on after it. In the registry (a generator that never finishes on its own)
and through the ingress's `RouterSessions` over the plain `Router` class: the ingress runs the
turn (and its deadline), the Router records it.

Reference: the same conversation without deadlines, and the chat template's rendering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from raylane.actors.engine.outputs import CompletionOutput, RequestOutput
from raylane.router.actor import Router
from raylane.router.errors import BadSessionRequest
from raylane.router.session_host import SessionSetup
from raylane.router.sessions import SessionRegistry
from raylane.router.tito import TemplateSplicer
from raylane.serve_backend import RouterSessions

from tests.tiny_models import make_tokenizer
from tests.unit.router_ingress import InProcessRouter
from tests.unit.sessions_helpers import Agent, make_registry, user


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


class EndlessGenerator:
    """A `TurnGenerator` that emits one id per `step_s` and never finishes by itself."""

    def __init__(self, tok, step_s: float = 0.005, first_after_s: float = 0.0) -> None:
        self.ids = tok.encode("ab", add_special_tokens=False)
        self.step_s, self.first_after_s = step_s, first_after_s
        self.running = 0
        self.closed = 0

    async def generate(self, prompt_ids, params, routing_key) -> AsyncIterator[RequestOutput]:
        self.running += 1
        try:
            await asyncio.sleep(self.first_after_s)
            ids: list[int] = []
            while True:
                await asyncio.sleep(self.step_s)
                ids.append(self.ids[len(ids) % len(self.ids)])
                choice = CompletionOutput(0, "ab" * (len(ids) // 2), list(ids), [-0.25] * len(ids))
                yield RequestOutput(
                    routing_key, None, prompt_ids, [choice], False, weight_version=4
                )
        finally:
            self.running -= 1
            self.closed += 1


async def test_past_the_deadline_the_partial_turn_is_recorded_as_aborted(tok):
    gen = EndlessGenerator(tok)
    registry = SessionRegistry(TemplateSplicer(tok), gen)
    agent = await Agent.start(registry)
    result = await agent.user("tell me everything", timeout_s=0.1)
    out = result.output
    assert out.finish_reason == "abort" and 0 < len(out.token_ids)
    assert gen.running == 0 and gen.closed == 1  # the generation was aborted, not left running
    record = (await registry.get(agent.id)).trajectory.records[-1]
    assert record.finish_reason == "abort" and record.output_ids == out.token_ids
    assert record.logprobs == out.logprobs and record.weight_version == 4
    assert result.weight_version == 4
    assert result.message == {"role": "assistant", "content": out.text}
    sample = await registry.sample(agent.id)
    assert sample.status == "aborted"
    assert sample.tokens[-len(out.token_ids) :] == out.token_ids
    assert sample.loss_mask == [0] * len(record.prompt_ids) + [1] * len(out.token_ids)


async def test_the_next_turn_continues_after_the_aborted_one(tok):
    gen = EndlessGenerator(tok)
    registry = SessionRegistry(TemplateSplicer(tok), gen)
    agent = await Agent.start(registry)
    aborted = (await agent.user("hello", timeout_s=0.05)).output
    registry.generator = make_registry(tok)[1]  # the next turn finishes by itself
    nxt = await agent.user("go on")
    assert nxt.output.finish_reason == "stop" and nxt.rolled_back == 0
    first, second = (await registry.get(agent.id)).trajectory.records
    assert first.output_ids == aborted.token_ids and second.prefix_len == first.end
    # cut mid-turn, the stored output gets the template's end of turn, as after max_tokens
    end_of_turn = TemplateSplicer(tok).next_turn([user("go on")], [])
    assert second.prompt_ids == end_of_turn
    assert (await registry.sample(agent.id)).status == "completed"


async def test_nothing_generated_by_the_deadline_is_an_empty_aborted_turn(tok):
    gen = EndlessGenerator(tok, first_after_s=10)  # still queueing at the deadline
    registry = SessionRegistry(TemplateSplicer(tok), gen)
    agent = await Agent.start(registry)
    out = (await agent.user("hello", timeout_s=0.05)).output
    assert out.finish_reason == "abort" and out.token_ids == [] and gen.running == 0
    assert (await registry.get(agent.id)).trajectory.records[-1].output_ids == []


async def test_a_turn_that_finishes_in_time_is_untouched(tok):
    registry, _ = make_registry(tok)
    reference, _ = make_registry(tok)
    timed, plain = await Agent.start(registry), await Agent.start(reference)
    for text in ("hello", "more"):
        a = await timed.user(text, timeout_s=30)
        b = await plain.user(text)
        assert a.output.finish_reason == "stop" and a.output.token_ids == b.output.token_ids
    got, want = await registry.sample(timed.id), await reference.sample(plain.id)
    assert got.to_json() == want.to_json()


async def test_the_ingress_aborts_the_turn_where_it_runs_and_the_router_records_it(tok):
    gen = EndlessGenerator(tok)  # in place of the ingress's replica generator
    router = Router(capacity=2)
    router.sessions.load_tokenizer = lambda _: tok
    shim = InProcessRouter(router)
    sessions = RouterSessions(shim, SessionSetup("tiny"), gen)
    session_id = await router.session_create(sessions.setup)
    results = [r async for r in sessions.chat_stream(session_id, [user("hi")], None, timeout_s=0.1)]
    final = results[-1]
    assert shim.session_turn.args[0] is sessions.setup  # the deadline stays at the ingress
    # the tokens went generator -> ingress; the Router sent the ticket and the committed turn
    assert len(results) > 3 and shim.session_turn.stream.sent == 2
    assert final.message is not None and final.output.finish_reason == "abort"
    assert final.output.token_ids and gen.running == 0 and gen.closed == 1
    assert [r.output.token_ids for r in results[:-1]] == [
        final.output.token_ids[: len(r.output.token_ids)] for r in results[:-1]
    ]
    record = (await router.session_describe(sessions.setup, session_id))["records"][-1]
    assert record["finish_reason"] == "abort" and record["output_ids"] == final.output.token_ids


@pytest.mark.parametrize("bad", [0, -1.5])
async def test_a_deadline_that_is_not_positive_is_refused_and_leaves_no_trace(tok, bad):
    registry, _ = make_registry(tok)
    agent = await Agent.start(registry)
    with pytest.raises(BadSessionRequest) as err:
        await agent.user("hello", timeout_s=bad)
    assert err.value.status == 400 and err.value.param == "timeout"
    assert len((await registry.get(agent.id)).trajectory) == 0
