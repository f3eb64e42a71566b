"""Tensor-parallel shape validation from HF configs alone (no weights), and the layers agree."""

from __future__ import annotations

import pytest
from raylane.actors.models import TPGroup, check_tp_shape
from raylane.actors.models.layers import MergedColumnParallelLinear, QKVParallelLinear
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig


def _llama(heads: int, kv_heads: int, intermediate: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=16 * heads,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
    )


def _smollm2() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    )


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_shape_splits_over_1_and_3(tp):
    check_tp_shape(_smollm2(), tp)


def test_smollm2_rejects_2_naming_heads_and_the_valid_sizes():
    with pytest.raises(ValueError) as err:
        check_tp_shape(_smollm2(), 2)
    assert str(err.value) == (
        "tensor_parallel_size=2 does not divide num_attention_heads=9; "
        "pick a tensor_parallel_size that divides 9 "
        "(valid for this model: 1, 3)"
    )


def test_smollm2_rejects_9_because_of_the_intermediate_size():
    # heads 9 / 9 and KV heads replicated 3x would work, but 1536 is not a multiple of 9
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=9 does not divide "
        r"intermediate_size=1536.*valid for this model: 1, 3\)",
    ):
        check_tp_shape(_smollm2(), 9)


def test_kv_heads_split_or_replicated():
    check_tp_shape(_llama(4, 2, 64), 2)  # split: one KV head per rank
    check_tp_shape(_llama(4, 2, 64), 4)  # replicated: each KV head on 2 ranks
    check_tp_shape(_llama(8, 1, 64), 8)  # MQA: the one KV head on every rank


def test_kv_heads_neither_split_nor_replicated():
    # 12 heads split over 6, but 4 KV heads can neither be split over 6 ranks nor replicated
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=6 neither divides "
        r"num_key_value_heads=4.*"
        r"valid for this model: 1, 2, 4, 12\)",
    ):
        check_tp_shape(_llama(12, 4, 96), 6)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):  # 3 KV heads over 2 ranks
        check_tp_shape(_llama(6, 3, 96), 2)


def test_dense_intermediate_size_not_divisible():
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 does not divide intermediate_size=102"
    ):
        check_tp_shape(_llama(4, 2, 102), 4)
    check_tp_shape(_llama(4, 2, 102), 2)


def _qwen3_moe(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **{
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "num_experts": 8,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            **overrides,
        }
    )


def test_moe_intermediate_size_not_divisible():
    check_tp_shape(_qwen3_moe(), 4)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 does not divide moe_intermediate_size=30"
    ):
        check_tp_shape(_qwen3_moe(moe_intermediate_size=30), 4)


def test_dense_size_matters_only_when_the_moe_model_has_dense_layers():
    check_tp_shape(_qwen3_moe(intermediate_size=7), 2)  # every layer is MoE
    with pytest.raises(ValueError, match="intermediate_size=7"):
        check_tp_shape(_qwen3_moe(intermediate_size=7, mlp_only_layers=[0]), 2)
    with pytest.raises(ValueError, match="intermediate_size=7"):  # layer 0 dense by sparse step
        check_tp_shape(_qwen3_moe(intermediate_size=7, decoder_sparse_step=2), 2)


def test_mixtral_experts_use_intermediate_size():
    config = MixtralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=30,
        num_local_experts=4,
    )
    check_tp_shape(config, 2)
    with pytest.raises(ValueError, match="intermediate_size=30"):
        check_tp_shape(config, 4)


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_tp_must_be_a_positive_integer(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tp_shape(_smollm2(), tp)


def test_layers_raise_the_same_rules():
    # the KV-head rule, and the same wording, when a model is built with a bad TP group
    with pytest.raises(
        ValueError, match="tensor_parallel_size=6 neither divides num_key_value_heads=4"
    ):
        QKVParallelLinear(192, 16, 12, 4, tp=TPGroup(0, 6))
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 does not divide "
        r"num_attention_heads=9.*\(e\.g\. 1, 3, 9\)",
    ):
        QKVParallelLinear(576, 64, 9, 3, tp=TPGroup(0, 2))
    layer = QKVParallelLinear(192, 16, 12, 4, tp=TPGroup(5, 12))  # 4 KV heads on 12 ranks
    assert (layer.num_heads, layer.num_kv_heads, layer.kv_replicas) == (1, 1, 3)
    with pytest.raises(ValueError, match="does not divide"):
        MergedColumnParallelLinear(64, [102, 102], tp=TPGroup(0, 4))
