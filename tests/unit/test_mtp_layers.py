"""DeepSeek-V3's MTP layers: loaded from the checkpoint's `model.layers.{L + k}` names and
run through `mtp_forward`, against Hugging Face's own `MtpLayer` built on the same weights."""

from __future__ import annotations

import os

import pytest
import torch
from raylane.actors.models import load_model

from tests.tiny_models import attach_kv_cache, make_deepseek_v3


def _hf_name(name: str, num_hidden_layers: int) -> str:
    """HF MtpModel parameter name -> the DeepSeek checkpoint's name."""
    _, k, rest = name.split(".", 2)  # layers.{k}.rest
    layer = f"model.layers.{num_hidden_layers + int(k)}."
    if rest.startswith("mtp_block."):
        return layer + rest.removeprefix("mtp_block.")
    if rest.startswith("post_norm."):
        return layer + "shared_head.norm." + rest.removeprefix("post_norm.")
    return layer + rest


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    return make_deepseek_v3_with_mtp(tmp_path_factory.mktemp("ds_mtp"))


def make_deepseek_v3_with_mtp(directory):
    """(model dir with one MTP layer in DeepSeek's layout, HF main model, HF MtpModel)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    path = make_deepseek_v3(directory)
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mtp = MtpModel(main, 1).eval()
    gen = torch.Generator().manual_seed(11)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layers = main.config.num_hidden_layers
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters(prefix="layers"):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
            tensors[_hf_name(name, layers)] = p.detach().clone()
        for name, b in mtp.layers.named_buffers(prefix="layers"):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
                tensors[_hf_name(name, layers)] = b.detach().clone()
    # the checkpoints' copies of the shared embedding and head, which the loader skips
    tensors[f"model.layers.{layers}.embed_tokens.weight"] = tensors[
        "model.embed_tokens.weight"
    ].clone()
    tensors[f"model.layers.{layers}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, main, mtp


def test_mtp_step_equals_hf_mtp_layer(with_mtp):
    from raylane.kernels.attention.builder import SeqSlice, build_metadata

    path, main, mtp = with_mtp
    ours, _, _ = load_model(path, torch.float32, "cpu")
    assert len(ours.mtp_layers) == 1 and len(ours.attention_layers()) == 4
    attach_kv_cache(ours, 8 * 16)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2))
    meta = build_metadata([SeqSlice(29, 29, [0, 1])], [], 16)
    with torch.no_grad():
        hidden, _ = ours(ids[:-1], torch.arange(29), meta)  # the main model at positions p
        mtp_meta = build_metadata([SeqSlice(29, 29, [2, 3])], [], 16)
        got, routed = ours.mtp_forward(0, ids[1:], torch.arange(29), hidden, mtp_meta)
        # HF: the same layer on token p + 1's embedding and our hidden state at p
        embeds = main.model.embed_tokens(ids[1:]).unsqueeze(0)
        position_ids = torch.arange(29).unsqueeze(0)
        cos_sin = main.model.rotary_emb(embeds, position_ids)
        mask = torch.full((29, 29), float("-inf")).triu(1).view(1, 1, 29, 29)
        ref = mtp.layers[0](embeds, hidden.unsqueeze(0), cos_sin, mask, position_ids, cache=None)[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.compute_logits(got), main.lm_head(ref), atol=1e-4, rtol=0)
    assert routed is not None and routed.shape == (29, 1, 2)


def test_checkpoint_without_mtp_weights_drops_the_layers(tiny_deepseek_dir):
    ours, config, _ = load_model(tiny_deepseek_dir, torch.float32, "cpu")
    assert config.num_nextn_predict_layers == 1  # the config names one; the checkpoint has none
    assert len(ours.mtp_layers) == 0 and len(ours.attention_layers()) == 3


def test_weight_updates_reach_the_mtp_layers(with_mtp):
    """A trainer's update under the checkpoint's names (`model.layers.{L}.*`) is checked by the
    shape-only twin and lands in the MTP layer; the shared-head copy is skipped."""
    from raylane.actors.models import load_weights
    from raylane.actors.models.loader import check_weights
    from raylane.actors.models.tp_group import TPGroup

    path, main, _ = with_mtp
    ours, config, _ = load_model(path, torch.float32, "cpu")
    layers = config.num_hidden_layers
    new = torch.full((config.hidden_size, 2 * config.hidden_size), 0.01)
    head = torch.zeros(config.vocab_size, config.hidden_size)
    update = [
        (f"model.layers.{layers}.eh_proj.weight", new),
        (f"model.layers.{layers}.shared_head.head.weight", head),
    ]
    specs = [(n, tuple(t.shape), torch.float32) for n, t in update]
    check_weights(type(ours), config, TPGroup(), torch.float32, specs)
    changed = load_weights(ours, update, partial=True)
    assert changed == {"mtp_layers.0.eh_proj.weight"}
    assert torch.equal(ours.mtp_layers[0].eh_proj.weight, new)
    with pytest.raises(ValueError, match="shape"):
        bad = [(f"model.layers.{layers}.eh_proj.weight", torch.zeros(3, 3))]
        load_weights(ours, bad, partial=True)
