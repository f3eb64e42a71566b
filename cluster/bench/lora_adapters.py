"""Random LoRA adapters in PEFT's on-disk format for the benches (no `peft` needed): an
`adapter_config.json` and an `adapter_model.safetensors` whose tensors carry PEFT's names
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), shaped for a Llama-style
model's attention and MLP projections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def projection_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection, from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    h, i = c.hidden_size, c.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def random_adapter_tensors(model_dir: str, rank: int, seed: int) -> list[tuple[str, Any]]:
    """Every layer's lora_A [rank, in] and lora_B [out, rank], float32, under PEFT's names."""
    import torch
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(layers):
        for module, (fan_in, fan_out) in projection_shapes(model_dir).items():
            block = "self_attn" if module in ATTENTION else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * 0.01
            named += [(f"{stem}.lora_A.weight", a), (f"{stem}.lora_B.weight", b)]
    return named


def write_random_adapter(model_dir: str, path: str | Path, rank: int = 16, seed: int = 0) -> str:
    """A PEFT adapter directory at `path` over `model_dir` (every projection, alpha 2 * rank)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "target_modules": list(ATTENTION + MLP),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tensors = dict(random_adapter_tensors(model_dir, rank, seed))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    return str(out)
