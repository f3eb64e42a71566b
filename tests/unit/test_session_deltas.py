"""A session turn's outputs stay the engine's deltas from the generator to the route: the
registry passes each delta on as it is (no cumulative output rebuilt and sliced again), folds
them once into the record, and a cumulative generator's outputs are read as what each added.

Reference: the steps' token chunks written out by hand, and their concatenation."""

from __future__ import annotations

import pytest
from raylane.actors.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    SampleDelta,
)
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.router.generator import RequestTurnGenerator, turn_deltas
from raylane.router.sessions import SessionRegistry
from raylane.router.tito import TemplateSplicer

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import user

# each step's (text, ids, logprobs); the last one finishes the turn
STEPS = [("he", [5, 6], [-0.5, -0.25]), ("", [7], [-1.0]), ("llo", [8, 9], [-0.125, -2.0])]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def engine_deltas(prompt_ids: list[int]) -> list[EngineCoreOutput]:
    """The steps as an engine hands them out: the prompt on the first, the blob-free finish."""
    last = len(STEPS) - 1
    return [
        EngineCoreOutput(
            "r",
            [SampleDelta(0, text, ids, lps, finish_reason="stop" if i == last else None)],
            i == last,
            weight_version=3 + i,
            prompt_token_ids=prompt_ids if i == 0 else None,
        )
        for i, (text, ids, lps) in enumerate(STEPS)
    ]


class DeltaGenerator:
    """A `TurnGenerator` that yields the engine's deltas; it keeps what it handed out."""

    def __init__(self) -> None:
        self.sent: list[EngineCoreOutput] = []

    async def generate(self, prompt_ids, params, routing_key):
        for delta in engine_deltas(prompt_ids):
            self.sent.append(delta)
            yield delta


async def test_the_registry_passes_the_engines_deltas_on_as_they_are(tok):
    gen = DeltaGenerator()
    registry = SessionRegistry(TemplateSplicer(tok), gen)
    session_id = await registry.create()
    steps = [s async for s in registry.chat_deltas(session_id, [user("hi")])]
    assert [s.delta for s in steps] == gen.sent
    assert all(s.delta is d for s, d in zip(steps, gen.sent))  # the same objects: no rebuild
    assert [s.committed is not None for s in steps] == [False, False, True]
    committed = steps[-1].committed
    assert committed.output.token_ids == [5, 6, 7, 8, 9]
    assert committed.output.text == "hello"
    assert committed.output.logprobs == [-0.5, -0.25, -1.0, -0.125, -2.0]
    assert committed.weight_version == 5 and committed.output.finish_reason == "stop"
    (record,) = (await registry.get(session_id)).trajectory.records
    assert record.output_ids == [5, 6, 7, 8, 9] and record.weight_version == 5


async def test_cumulative_views_of_the_deltas_are_every_output_so_far(tok):
    registry = SessionRegistry(TemplateSplicer(tok), DeltaGenerator())
    session_id = await registry.create()
    results = [r async for r in registry.chat_stream(session_id, [user("hi")])]
    want_ids = [[5, 6], [5, 6, 7], [5, 6, 7, 8, 9]]
    assert [r.output.token_ids for r in results] == want_ids
    assert [r.output.text for r in results] == ["he", "he", "hello"]
    assert [r.weight_version for r in results] == [3, 4, 5]
    assert results[-1].message == {"role": "assistant", "content": "hello"}


async def test_a_cumulative_generators_outputs_are_read_as_what_each_added():
    async def cumulative():
        text, ids, lps = "", [], []
        for i, (t, new_ids, new_lps) in enumerate(STEPS):
            text, ids, lps = text + t, ids + new_ids, lps + new_lps
            done = i == len(STEPS) - 1
            choice = CompletionOutput(0, text, ids, lps, finish_reason="stop" if done else None)
            yield RequestOutput("r", None, [1, 2], [choice], done, weight_version=3)

    deltas = [d async for d in turn_deltas(cumulative())]
    got = [(d.outputs[0].text, d.outputs[0].token_ids, d.outputs[0].logprobs) for d in deltas]
    assert got == STEPS
    assert [d.prompt_token_ids for d in deltas] == [[1, 2], None, None]
    assert [d.finished for d in deltas] == [False, False, True]


async def test_a_request_turn_is_the_request_paths_deltas_unchanged():
    sent = engine_deltas([1, 2])

    class Requests:
        async def generate(self, prompt_ids, params, request_id, routing_key=None):
            for delta in sent:
                yield delta

    outs = RequestTurnGenerator(Requests()).generate([1, 2], SamplingParams(), "sess-x")
    got = [d async for d in outs]
    assert all(g is s for g, s in zip(got, sent)) and len(got) == len(sent)
