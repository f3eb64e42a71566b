"""PEFT adapters made for tests: `LoraConfig(init_lora_weights=False)` (random A and B) over a
tiny model, saved with `PeftModel.save_pretrained`, and the PEFT reference model to compare to."""

from __future__ import annotations

import os
from typing import Any

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str, path: str | os.PathLike, seed: int = 0, r: int = 4, **config: Any
) -> str:
    """A PEFT LoRA adapter directory over `base_dir` (random A and B, seeded)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config.setdefault("target_modules", ALL)
    config.setdefault("lora_alpha", 2 * r)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(base, _config(r, config))
        with torch.no_grad():  # B drawn large enough that the adapter changes greedy tokens
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.3)
    model.save_pretrained(str(path))
    return str(path)


def _config(r: int, config: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, init_lora_weights=False, **config)


def peft_models(base_dir: str, adapters: dict[str, str]) -> Any:
    """One PeftModel over a fresh base with every adapter loaded under its name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def peft_greedy(model: Any, adapter: str | None, prompt: list[int], max_tokens: int):
    """Greedy tokens and each token's logprob under `adapter` (None: the base model)."""
    ids, logprobs = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    logits = model(torch.tensor([ids])).logits[0, -1]
            else:
                model.set_adapter(adapter)
                logits = model(torch.tensor([ids])).logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        token = int(lp.argmax())
        ids.append(token)
        logprobs.append(float(lp[token]))
    return ids[len(prompt) :], logprobs


def rewritten(src: str, dst: str | os.PathLike, change: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """A copy of PEFT adapter `src` whose tensors are `change(name, tensor)`; returns the new
    directory and the changed tensors (an update's payload, and its PEFT reference)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "adapter_model.safetensors")
    tensors = {name: change(name, t) for name, t in load_file(file).items()}
    save_file(tensors, file)
    return str(dst), tensors
