"""Tiny random-weight models and a tiny tokenizer, built offline for tests.

`make_llama` / `make_qwen2` / `make_qwen3` / `make_qwen3_moe` write a float32 HF directory
(config, safetensors, tokenizer with a ChatML chat template) and return its path. Weights are
seeded and drawn with a large `initializer_range` so logits are peaked: greedy argmax has no
near-ties and exact-match tests against HF are not flaky.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384

# ChatML with a system prompt, tool definitions, assistant tool calls and the tool role.
# NOTE: transformers renders with trim_blocks, so a newline right after a block tag is dropped.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}{{ '\\n' }}<tool_call>\n"
    "{{ (call.function if call.function is defined else call) | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a haiku about the sea: waves fold into foam, the tide keeps its slow promise.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "The assistant calls a tool, reads the result and answers the user.",
    '{"name": "get_weather", "arguments": {"city": "Berlin"}}',
    "Reinforcement learning trains a policy from rewards over many rollouts.",
]


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def make_tokenizer() -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with a ChatML chat template; eos <|im_end|>."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _common(tokenizer: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.3,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _save(
    path: str | os.PathLike,
    config_cls: Any,
    model_cls: Any,
    seed: int,
    overrides: dict[str, Any],
    **defaults: Any,
) -> str:
    tokenizer = make_tokenizer()
    config = config_cls(**{**_common(tokenizer), **defaults, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_llama(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Llama with GQA (4 heads / 2 KV heads); override e.g. head_dim, tie_word_embeddings,
    rope_scaling={"rope_type": "llama3", ...}, attention_bias."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save(path, LlamaConfig, LlamaForCausalLM, seed, overrides)


def make_qwen2(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen2 (bias on q/k/v)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save(path, Qwen2Config, Qwen2ForCausalLM, seed, overrides, use_sliding_window=False)


def make_qwen3(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen3 (q/k norm) with head_dim 32 != hidden / heads, 3 layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save(
        path,
        Qwen3Config,
        Qwen3ForCausalLM,
        seed,
        overrides,
        head_dim=32,
        num_hidden_layers=3,
        use_sliding_window=False,
    )


def make_qwen3_moe(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen3-MoE, 8 experts top-2, 4 layers: 0 and 2 dense (`mlp_only_layers`), 1 and 3 MoE.
    Override `decoder_sparse_step=2, mlp_only_layers=[]` for the same mix by sparse step."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _save(
        path,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        seed,
        overrides,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[0, 2],
        norm_topk_prob=True,
        head_dim=16,
        use_sliding_window=False,
    )


def make_mixtral(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Mixtral, 4 experts top-2 on both layers (expert intermediate size 32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _save(
        path,
        MixtralConfig,
        MixtralForCausalLM,
        seed,
        overrides,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def make_deepseek_v3(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """DeepSeek-V3, 3 layers: layer 0 dense (`first_k_dense_replace=1`), 1 and 2 MoE with 8
    routed experts in 4 groups (top-2 groups, top-2 experts) plus one shared expert; MLA with
    q_lora_rank 24 (override `q_lora_rank=None` for a plain q_proj), kv_lora_rank 32, nope 16,
    rope 8 (interleaved), v 16. The routers' `e_score_correction_bias` is drawn at random (HF
    initialises it to zero), so the biased choice differs from the unbiased weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    defaults = {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
    }
    path = _save(path, DeepseekV3Config, DeepseekV3ForCausalLM, seed, overrides, **defaults)
    _randomize_router_bias(path, seed)
    return path


def make_deepseek_v2(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """DeepSeek-V2: V3's tiny shape (see make_deepseek_v3) with softmax routing,
    "group_limited_greedy" over 4 groups (top-2) and two shared experts."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    defaults = {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
    }
    return _save(path, DeepseekV2Config, DeepseekV2ForCausalLM, seed, overrides, **defaults)


def make_deepseek_v32(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """DeepSeek-V3.2: make_deepseek_v3's shape with DSA on every layer: an indexer of 8 heads
    of 16 dims choosing `index_topk` 12 positions, fewer than the test prompts hold."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    defaults = {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 12,
    }
    path = _save(path, DeepseekV32Config, DeepseekV32ForCausalLM, seed, overrides, **defaults)
    _randomize_router_bias(path, seed)
    return path


def make_glm_moe_dsa(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """GLM-5 (GlmMoeDsa): make_deepseek_v32's shape, 4 layers whose indexers are full,
    shared, full, shared (`indexer_types`): the shared ones reuse the layer before's picks."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    defaults = {
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 12,
        "indexer_types": ["full", "shared", "full", "shared"],
    }
    path = _save(path, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, seed, overrides, **defaults)
    _randomize_router_bias(path, seed)
    return path


def make_glm4_moe(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """GLM-4.5-style MoE, 3 layers: layer 0 dense, 1 and 2 MoE (8 experts, 2 groups, top-2,
    one shared expert) under GQA attention with q/k/v bias, q/k norm and RoPE on half of each
    32-dim head (`partial_rotary_factor` 0.5). Random router correction biases."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    defaults = {
        "num_hidden_layers": 3,
        "head_dim": 32,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
    }
    path = _save(path, Glm4MoeConfig, Glm4MoeForCausalLM, seed, overrides, **defaults)
    _randomize_router_bias(path, seed)
    return path


def make_gemma3(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Gemma 3 text: sliding (window 8), full, sliding layers with their own RoPE bases."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    defaults = {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }
    return _save(path, Gemma3TextConfig, Gemma3ForCausalLM, seed, overrides, **defaults)


def make_gpt_oss(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """gpt-oss: sliding (window 8) / full layers alternating, sinks, YaRN, 4 experts top-2."""
    from transformers import GptOssConfig, GptOssForCausalLM

    defaults = {
        "head_dim": 16,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 256,
            "truncate": False,
        },
    }
    return _save(path, GptOssConfig, GptOssForCausalLM, seed, overrides, **defaults)


def make_qwen3_5(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen3.5 text: linear, linear, full layers; grouped linear heads (2 key / 4 value),
    partial rotary; A_log and dt_bias randomised (HF initialises them to constants)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config_cls, model_cls = overrides.pop("_classes", (Qwen3_5TextConfig, Qwen3_5ForCausalLM))
    defaults = {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
    }
    path = _save(path, config_cls, model_cls, seed, overrides, **defaults)
    _randomize(path, seed, ("A_log", "dt_bias"))
    return path


def make_qwen3_5_moe(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen3.5-MoE text: make_qwen3_5's layers, every MLP 4 experts top-2 + a gated shared one."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    moe = {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    return make_qwen3_5(
        path, seed, _classes=(Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM), **{**moe, **overrides}
    )


def make_qwen3_next(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Qwen3-Next: make_qwen3_5's layers with fused per-key-head projections; layers 0 and 2
    a shared-expert MoE (4 experts top-2), layer 1 dense (`mlp_only_layers`)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    defaults = {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5
        },
    }  # fmt: skip
    classes = (Qwen3NextConfig, Qwen3NextForCausalLM)
    return make_qwen3_5(path, seed, _classes=classes, **{**defaults, **overrides})


def _randomize(path: str, seed: int, suffixes: tuple[str, ...]) -> None:
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(suffixes)]:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen).clamp(-2, 2)
    save_file(tensors, file, metadata={"format": "pt"})


def _randomize_router_bias(path: str, seed: int) -> None:
    """Rewrite the checkpoint with seeded `e_score_correction_bias` values."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 0.1 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})


def attach_kv_cache(model: Any, num_slots: int) -> None:
    """Give every attention layer of one of our models a zeroed paged KV cache."""
    dtype = next(model.parameters()).dtype
    for layer in model.attention_layers():
        layer.attach_cache(
            [torch.zeros((num_slots, *shape), dtype=dtype) for shape in layer.cache_shapes()]
        )


def run_prefill(
    model: Any, token_ids: list[int], start: int = 0, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run tokens[start:] of one sequence as one prefill chunk whose first `start` tokens are
    already in the cache (blocks 0, 1, ... in order). Returns (logits [T, V], routed or None)."""
    from raylane.kernels.attention.builder import SeqSlice, build_metadata

    n = len(token_ids)
    table = list(range(-(-n // block_size)))
    meta = build_metadata(
        [SeqSlice(num_new=n - start, context_len=n, block_table=table)], [], block_size
    )
    ids = torch.tensor(token_ids[start:], dtype=torch.long)
    positions = torch.arange(start, n, dtype=torch.long)
    with torch.no_grad():
        hidden, routed = model(ids, positions, meta)
        return model.compute_logits(hidden), routed
