"""A server whose engine speculates: the `openai` client gets the text and logprobs the offline
engine without speculation gives, and /metrics carries the spec_decode counters, equal to the
engine's own (which the unit tests check against the wire)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from raylane.actors.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.unit.spec.helpers import make_loopy_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("loopy") / "model")


@pytest.fixture(scope="module")
def spec_server(loopy_dir) -> Iterator[tuple[ServerThread, LLMEngine]]:
    engine = LLMEngine(tiny_config(loopy_dir, speculative_config=SPEC))
    app = build_app(local_backend(AsyncLLMEngine(engine), "loopy"))
    with ServerThread(app) as server:
        yield server, engine
    engine.shutdown()


def test_served_greedy_text_equals_no_speculation_and_metrics(spec_server, loopy_dir):
    server, engine = spec_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    reference = LLMEngine(tiny_config(loopy_dir))
    prompts = [[200, 218, 23, 135, 264, 251, 17, 9], [40, 353, 172, 244, 289, 54, 77]]
    for prompt in prompts:
        got = client.completions.create(
            model="loopy", prompt=prompt, max_tokens=40, temperature=0, logprobs=1
        )
        (want,) = reference.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=40, logprobs=1), use_tqdm=False
        )
        assert got.choices[0].text == want.outputs[0].text
        lps = got.choices[0].logprobs.token_logprobs
        assert all(abs(a - b) <= 1e-4 for a, b in zip(lps, want.outputs[0].logprobs))
    reference.shutdown()
    stats = engine.stats
    assert stats.spec_decode_num_accepted_tokens > 0
    scrape = {
        (s.name, s.labels.get("position")): s.value
        for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        for s in f.samples
    }
    assert scrape["raylane:spec_decode_num_drafts_total", None] == stats.spec_decode_num_drafts
    assert (
        scrape["raylane:spec_decode_num_draft_tokens_total", None]
        == stats.spec_decode_num_draft_tokens
    )
    assert (
        scrape["raylane:spec_decode_num_accepted_tokens_total", None]
        == stats.spec_decode_num_accepted_tokens
    )
    for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        assert scrape["raylane:spec_decode_num_accepted_tokens_per_pos_total", str(pos)] == count
