"""Loading: sharded vs single safetensors, checkpoint layouts, dtype, registry and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from raylane.actors.models import get_model_class, load_model, load_tokenizer, load_weights
from raylane.actors.models.loader import iter_checkpoint, resolve_dtype

from tests.tiny_models import attach_kv_cache, run_prefill


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reshard(src: str, dst, **kwargs) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, **kwargs)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return str(dst)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_moe_dir"])
def test_sharded_load_equals_single_file_load(fixture, request, tmp_path):
    single = request.getfixturevalue(fixture)
    sharded = _reshard(single, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    a, _, _ = load_model(single, "float32")
    b, _, model_dir = load_model(sharded, "float32")
    assert model_dir == sharded
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = list(range(3, 40))
    attach_kv_cache(a, 48)
    attach_kv_cache(b, 48)
    assert torch.equal(run_prefill(a, ids)[0], run_prefill(b, ids)[0])


def test_fused_3d_expert_layout_loads_like_per_expert(tiny_moe_dir):
    """transformers 5 keeps experts as gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    per_expert, config, _ = load_model(tiny_moe_dir, "float32")
    weights = {k: v.materialize() for k, v in iter_checkpoint(tiny_moe_dir)}
    fused: dict[str, torch.Tensor] = {}
    for layer in (1, 3):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.num_experts)
        gate = torch.stack([weights.pop(f"{prefix}.{e}.gate_proj.weight") for e in experts])
        up = torch.stack([weights.pop(f"{prefix}.{e}.up_proj.weight") for e in experts])
        fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{prefix}.down_proj"] = torch.stack(
            [weights.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
        )
    model = get_model_class(config)(config)
    load_weights(model, list(weights.items()) + list(fused.items()))
    sa, sb = _state(per_expert), _state(model)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tied_embeddings_share_one_tensor(tmp_path):
    from tests.tiny_models import make_llama

    path = make_llama(tmp_path, tie_word_embeddings=True)
    model, _, _ = load_model(path, "float32")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_and_unexpected_weights_are_value_errors(tiny_llama_dir):
    _, config, _ = load_model(tiny_llama_dir, "float32")
    weights = dict(iter_checkpoint(tiny_llama_dir))
    fresh = get_model_class(config)(config)
    with pytest.raises(ValueError, match="lacks"):
        load_weights(fresh, [(k, v) for k, v in weights.items() if "layers.1.mlp" not in k])
    with pytest.raises(ValueError, match="matches no model parameter"):
        load_weights(fresh, [*weights.items(), ("model.layers.9.extra.weight", torch.ones(2))])
    bad = dict(weights, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        load_weights(fresh, bad.items())
    bad = dict(weights, **{"model.embed_tokens.weight": torch.ones(5, config.hidden_size)})
    with pytest.raises(ValueError, match="vocab_size"):
        load_weights(fresh, bad.items())


def test_dtype_resolution_and_bfloat16_load(tiny_llama_dir):
    model, config, _ = load_model(tiny_llama_dir, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_cache.dtype == torch.bfloat16
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype(None, config) == torch.float32
    assert resolve_dtype(torch.float16, config) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", config)


def test_registry_and_bad_paths(tmp_path, tiny_llama_dir):
    from transformers import AutoConfig

    assert get_model_class("Qwen3MoeForCausalLM").__name__ == "Qwen3MoeForCausalLM"
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="LlamaForCausalLM"):  # lists the supported ones
        get_model_class(config)
    with pytest.raises(ValueError, match="model"):
        load_model(tmp_path / "nowhere", "float32")
    config.architectures = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))  # but no weights
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path, "float32")


def test_load_tokenizer_has_chat_template_and_eos(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 80)),  # too wide along the row split
        ("model.layers.0.self_attn.q_proj.weight", (80, 64)),  # too tall along the column split
        ("model.layers.0.self_attn.k_proj.weight", (16, 64)),  # too short: a rank would run off
        ("model.layers.0.mlp.gate_proj.weight", (136, 64)),
    ],
)
def test_wrong_size_along_the_split_dim_is_a_value_error_on_every_rank(
    tiny_llama_dir, name, shape, world
):
    from raylane.actors.models import TPGroup

    _, config, _ = load_model(tiny_llama_dir, "float32")
    weights = {k: v.materialize() for k, v in iter_checkpoint(tiny_llama_dir)}
    assert tuple(weights[name].shape) != shape
    weights[name] = torch.ones(shape)
    for rank in range(world):
        fresh = get_model_class(config)(config, TPGroup(rank, world))
        with pytest.raises(ValueError, match=r"expected \d+ along dim"):
            load_weights(fresh, weights.items())
