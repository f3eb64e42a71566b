"""SamplingParams and EngineConfig: valid input builds; a bad field is a ValueError naming it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.sampling_params import SamplingParams

NAN = math.nan


def test_sampling_params_defaults_construct():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop_list == [] and not p.greedy and not p.uses_penalties


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"top_k": -1},
        {"top_k": 5},
        {"top_p": 1},
        {"top_p": 0.01},
        {"min_p": 1.0},
        {"max_tokens": None},
        {"max_tokens": 1, "min_tokens": 1},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"seed": 0},
        {"logprobs": 0},
        {"prompt_logprobs": 3},
        {"stop_token_ids": [0, 7]},
        {"stop": ["a", "bc"]},
        {"repetition_penalty": 0.5},
        {"n": 4, "ignore_eos": True},
    ],
)
def test_sampling_params_valid_values_construct(kwargs):
    SamplingParams(**kwargs)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="END").stop_list == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop_list == ["a", "b"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(presence_penalty=0.1).uses_penalties


BAD_SAMPLING = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", "2"),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", NAN),
    ("temperature", "1"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", NAN),
    ("top_p", "0.5"),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", "3"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", NAN),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3),
    ("presence_penalty", NAN),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", NAN),
    ("seed", "x"),
    ("seed", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("logprobs", -1),
    ("logprobs", 1.5),
    ("prompt_logprobs", -1),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", "no"),
    ("skip_special_tokens", "no"),
    ("return_routed_experts", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_sampling_params_bad_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


@pytest.mark.parametrize(
    ("cls", "kwargs", "typo", "hint"),
    [
        (SamplingParams, {}, "temprature", "temperature"),
        (SamplingParams, {}, "max_token", "max_tokens"),
        (EngineConfig, {"model": "m"}, "max_num_seq", "max_num_seqs"),
        (EngineConfig, {"model": "m"}, "enable_prefix_cache", "enable_prefix_caching"),
    ],
)
def test_unknown_field_names_itself_and_the_closest_match(cls, kwargs, typo, hint):
    with pytest.raises(ValueError) as err:
        cls(**kwargs, **{typo: 1})
    assert repr(typo) in str(err.value) and repr(hint) in str(err.value)


def test_unknown_field_without_a_close_match_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        SamplingParams(zzzzzz=1)
    assert "zzzzzz" in str(err.value) and "temperature" in str(err.value)


def test_too_many_positional_fields():
    with pytest.raises(ValueError):
        SamplingParams(*range(40))


# --- EngineConfig -----------------------------------------------------------------------------


def test_engine_config_defaults_construct():
    c = EngineConfig(model="/some/dir")
    assert (c.block_size, c.dtype, c.enable_prefix_caching, c.tensor_parallel_size) == (
        16,
        "auto",
        True,
        1,
    )
    assert not c.enable_return_routed_experts


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "float16"},
        {"block_size": 1},
        {"max_model_len": None},
        {"max_model_len": 64},
        {"num_kv_blocks": 8},
        {"kv_cache_memory_gb": 0.5},
        {"kv_cache_memory_gb": 2},
        {"enable_prefix_caching": False},
        {"seed": 123},
        {"tokenizer": "/tok"},
        {"device": "cpu"},
    ],
)
def test_engine_config_valid_values_construct(kwargs):
    EngineConfig(model="m", **kwargs)


def test_engine_config_is_frozen():
    c = EngineConfig(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32


BAD_ENGINE = [
    ("model", 5),
    ("model", None),
    ("dtype", "fp32"),
    ("dtype", 32),
    ("block_size", 0),
    ("block_size", -16),
    ("block_size", 16.0),
    ("block_size", True),
    ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", "2048"),
    ("max_model_len", 0),
    ("max_model_len", 1.5),
    ("num_kv_blocks", 0),
    ("num_kv_blocks", "8"),
    ("kv_cache_memory_gb", 0),
    ("kv_cache_memory_gb", -1.0),
    ("kv_cache_memory_gb", "1"),
    ("tensor_parallel_size", 0),
    ("tensor_parallel_size", 1.0),
    ("distributed_executor_backend", "mp"),
    ("distributed_executor_backend", 1),
    ("max_logprobs", 0),
    ("seed", "x"),
    ("seed", 1.5),
    ("tokenizer", 5),
    ("device", 5),
    ("attention_backend", 3),
    ("enable_prefix_caching", "no"),
    ("enable_return_routed_experts", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_ENGINE)
def test_engine_config_bad_field_is_a_value_error_naming_it(field, value):
    kwargs = {"model": "m", field: value}
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_in_process_executor_with_tensor_parallelism_is_a_value_error():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 'ray'"):
        EngineConfig(model="m", tensor_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize(
    ("tp", "backend", "expected"),
    [(1, None, "uni"), (2, None, "ray"), (1, "ray", "ray"), (1, "uni", "uni"), (3, "ray", "ray")],
)
def test_executor_backend_follows_vllm(tp, backend, expected):
    config = EngineConfig(model="m", tensor_parallel_size=tp, distributed_executor_backend=backend)
    assert config.executor_backend == expected
