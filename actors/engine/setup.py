"""Build what an engine runs on: tokenizer, model runner, block manager. The only torch import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.detokenizer import StopChecker


@dataclass
class EngineParts:
    config: EngineConfig  # with max_model_len and num_kv_blocks resolved
    tokenizer: object
    runner: object  # actors.runner.ModelRunner
    block_manager: BlockManager
    stop_checker: StopChecker
    vocab_size: int
    num_moe_layers: int


def build_engine_parts(config: EngineConfig) -> EngineParts:
    import torch

    from actors.models import load_model, load_tokenizer
    from actors.runner.model_runner import ModelRunner

    device = _device(config.device, torch)
    model, hf_config, model_dir = load_model(config.model, _dtype(config.dtype, device),
                                             device)
    dtype = next(model.parameters()).dtype
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    eos = _eos_token_ids(hf_config, tokenizer, model_dir)
    max_len = config.max_model_len or getattr(hf_config, "max_position_embeddings", 4096)
    runner = ModelRunner(config, model, hf_config, device, dtype, eos)
    config = dataclasses.replace(config, max_model_len=max_len, num_kv_blocks=runner.num_kv_blocks)
    return EngineParts(
        config=config,
        tokenizer=tokenizer,
        runner=runner,
        block_manager=BlockManager(runner.num_kv_blocks, config.block_size,
                                   config.enable_prefix_caching),
        stop_checker=StopChecker(eos, max_len),
        vocab_size=hf_config.vocab_size,
        num_moe_layers=getattr(model, "num_moe_layers", 0),
    )


def _device(name: str, torch):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"EngineConfig.device: {e}") from None


def _dtype(name: str, device) -> str:
    # float32 on CPU: bf16 matmuls are slower there and outputs should match HF exactly;
    # elsewhere "auto" lets the loader take the checkpoint's dtype
    return "float32" if name == "auto" and device.type == "cpu" else name


def _eos_token_ids(hf_config, tokenizer, model_dir: str) -> list[int]:
    from transformers import GenerationConfig

    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen = None
    for value in (gen, getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return sorted(set(ids))
