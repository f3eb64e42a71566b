"""The limits the ingress asks for are the ones the engine enforces, read from config.json."""

from __future__ import annotations

import json
import os

import pytest
from raylane.actors.engine import EngineConfig, LLMEngine
from raylane.actors.engine.limits import read_model_limits


def config_json(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def test_limits_come_from_the_checkpoint_unless_the_engine_is_told(tiny_llama_dir):
    raw = config_json(tiny_llama_dir)
    limits = read_model_limits(EngineConfig(model=tiny_llama_dir))
    assert (limits.max_model_len, limits.vocab_size) == (
        raw["max_position_embeddings"],
        raw["vocab_size"],
    )
    assert not limits.is_moe
    told = read_model_limits(EngineConfig(model=tiny_llama_dir, max_model_len=40))
    assert told.max_model_len == 40


def test_a_moe_checkpoint_says_so(tiny_moe_dir):
    assert read_model_limits(EngineConfig(model=tiny_moe_dir)).is_moe


@pytest.mark.parametrize("max_model_len", [None, 40])
def test_the_engine_enforces_the_limits_it_reports(tiny_llama_dir, max_model_len):
    config = EngineConfig(model=tiny_llama_dir, max_model_len=max_model_len)
    limits = read_model_limits(config)
    engine = LLMEngine(config)
    try:
        assert engine.config.max_model_len == limits.max_model_len
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("r0", [1] * limits.max_model_len, None)
        with pytest.raises(ValueError, match="token ids"):
            engine.add_request("r1", [limits.vocab_size], None)
        engine.add_request("r2", [limits.vocab_size - 1] * (limits.max_model_len - 1), None)
        engine.abort_request("r2")
    finally:
        engine.shutdown()
