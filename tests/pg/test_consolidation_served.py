"""The consolidation actor's LLM is the cluster's own endpoint: `OpenAICompatibleLLM` against the
HTTP app (the same app `raylane serve` runs) on the embedded SmolLM2, with a real PostgreSQL.

Each call sends the batch's answer schema as a `json_schema` response format; constrained
decoding makes every answer valid by construction, so no memory is marked failed and no batch
is split, even though a 135M model asked free-form would rarely produce this shape.
"""

from __future__ import annotations

import json

import pytest
from raylane.actors.consolidation import ConsolidationConfig, Consolidator
from raylane.actors.consolidation.llm import OpenAICompatibleLLM
from raylane.actors.consolidation.prompt import parse_answer

from tests.e2e.server import ServerThread
from tests.pg.checks import assert_each_memory_once

pytestmark = pytest.mark.slow


class RecordingLLM(OpenAICompatibleLLM):
    """The real client, keeping each answer so the test can check it on its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answers: list[tuple[list[dict], dict, str]] = []

    async def complete(self, messages, *, response_format=None) -> str:
        text = await super().complete(messages, response_format=response_format)
        self.answers.append((messages, response_format, text))
        return text


@pytest.fixture(scope="module")
def served_url(smollm2_dir):
    from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
    from raylane.session_server.app import build_app
    from raylane.session_server.backend import local_backend

    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype="float32", num_kv_blocks=512))
    with ServerThread(build_app(local_backend(AsyncLLMEngine(engine), "smollm2"))) as server:
        yield server.url
    engine.shutdown()


async def test_consolidation_over_the_served_model_fails_no_memory(
    served_url, store, bank, metrics
) -> None:
    items = [
        ("The user prefers tea over coffee.", ["prefs"]),
        ("The user drinks green tea every morning.", ["prefs"]),
        ("skip: hello there", ["chat"]),
        ("The user's dog is called Rex.", ["pets"]),
        ("Rex is a beagle.", ["pets"]),
    ]
    await store.retain_many(bank, items)
    llm = RecordingLLM(served_url + "/v1", "smollm2", max_tokens=512)
    config = ConsolidationConfig(batch_size=4, llm_batch_size=2)
    result = await Consolidator(store, llm, config, metrics=metrics).run(bank)

    assert result.status == "completed"
    assert result.total.failed == 0 and result.total.consolidated == len(items)
    assert llm.answers and len(llm.answers) == result.total.llm_calls  # nothing was split
    skipped = {
        int(i)
        for _, _, text in llm.answers
        for i, action in json.loads(text).items()
        if action["action"] == "skip"
    }
    await assert_each_memory_once(store, bank, skipped=skipped)
    for _, response_format, text in llm.answers:
        schema = response_format["json_schema"]["schema"]
        answer = json.loads(text)  # valid JSON, keyed by exactly the batch's ids
        assert sorted(answer) == sorted(schema["required"])
        ids = [int(i) for i in schema["required"]]
        observations = schema["properties"][str(ids[0])]["anyOf"]
        scope = [
            int(i)
            for branch in observations
            if "observation_id" in branch["properties"]
            for i in branch["properties"]["observation_id"]["enum"]
        ]
        parse_answer(text, ids, scope)  # the consolidator's own validation accepts it
