"""Fixtures of the speculative-decoding tests: the loopy tiny Llama (greedy output falls
into cycles, so n-gram drafts get accepted), an engine without speculation on it (the
reference), and random prompts."""

from __future__ import annotations

import pytest

from tests.unit.async_helpers import prompts_for
from tests.unit.spec.helpers import make_loopy_llama, spec_engine

LENGTHS = (9, 17, 30, 45)


@pytest.fixture(scope="session")
def loopy_dir(tmp_path_factory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("loopy") / "model")


@pytest.fixture(scope="module")
def reference(loopy_dir):
    engine = spec_engine(loopy_dir, None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    return prompts_for(reference.validator.vocab_size, LENGTHS)
