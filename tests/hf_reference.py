"""Hugging Face reference runs for engine tests: greedy ids, raw logprobs, router picks."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


@torch.inference_mode()
def hf_greedy(
    model_dir: str, prompt: list[int], max_new: int, device: str = "cpu"
) -> tuple[list[int], list[float]]:
    """HF `generate(do_sample=False)` ids and the log_softmax of its logits at each chosen id."""
    model = hf_model(model_dir, device)
    # eos_token_id=None: never stop early, like ignore_eos (min_new_tokens would instead mask
    # EOS out of the logits and change the greedy choice)
    out = model.generate(
        torch.tensor([prompt], device=device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    assert len(ids) == max_new, "the reference stopped early"
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids)
    ]
    return ids, logprobs


@torch.inference_mode()
def hf_router_topk(model_dir: str, token_ids: list[int], device: str = "cpu") -> torch.Tensor:
    """The experts HF's routers pick for each token: [len(token_ids), num_moe_layers, top_k].

    Read with forward hooks on the gate (router) modules of the HF model.
    """
    return router_topk(hf_model(model_dir, device), token_ids, device)


@torch.inference_mode()
def router_topk(model: Any, token_ids: list[int], device: str = "cpu") -> torch.Tensor:
    """`hf_router_topk` of a model already built (e.g. a PeftModel with an adapter set)."""
    top_k = model.config.num_experts_per_tok
    picks: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        if isinstance(output, tuple) and len(output) == 3:  # (logits, scores, indices)
            picks.append(output[2])
        else:  # an older router that returns only its logits
            picks.append(torch.softmax(output.float(), -1).topk(top_k, dim=-1).indices)

    gates = [m for name, m in model.named_modules() if name.endswith(("mlp.gate", "mlp.router"))]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        model(torch.tensor([token_ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([p.reshape(len(token_ids), top_k).cpu() for p in picks], dim=1)


def perturbed_model(
    model_dir: str,
    out_dir: str,
    seed: int,
    scale: float = 0.05,
) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """The model's weights plus seeded Gaussian noise, saved as their own HF model in `out_dir`
    (for reference runs) and returned as named HF tensors (what a trainer sends):
    (out_dir, [(name, tensor)])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir, [(n, p.detach().clone()) for n, p in model.named_parameters()]


@torch.inference_mode()
def hf_indexer_topk(model_dir: str, token_ids: list[int], device: str = "cpu") -> np.ndarray:
    """The positions HF's DSA indexers pick for each token, read with forward hooks on the
    indexer modules: [len(token_ids), num_layers, index_topk] int32, each row the visible
    picks ascending, -1 padded (HF's topk also returns masked future positions while fewer
    than index_topk are visible; those are dropped here)."""
    model = hf_model(model_dir, device)
    topk = model.config.index_topk
    picks: list[torch.Tensor] = []
    indexers = [m for name, m in model.named_modules() if name.endswith("self_attn.indexer")]
    handles = [m.register_forward_hook(lambda _m, _i, out: picks.append(out[0])) for m in indexers]
    try:
        model(torch.tensor([token_ids], device=device))
    finally:
        for h in handles:
            h.remove()
    n = len(token_ids)
    out = np.full((n, len(picks), topk), -1, dtype=np.int32)
    for layer, chosen in enumerate(picks):  # [n, k]
        for pos, row in enumerate(chosen.tolist()):
            visible = sorted(p for p in row if p <= pos)
            out[pos, layer, : len(visible)] = visible
    return out
