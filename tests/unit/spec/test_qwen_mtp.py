"""MTP drafts (method "mtp") from Qwen3.5's and Qwen3-Next's own MTP module (`mtp.*` in their
checkpoints; transformers does not implement it, so the tiny checkpoints here get one written
in, and the reference for each draft is a naive computation in this file from those tensors,
with Hugging Face's own decoder layer as the MTP block): greedy tokens and logprobs equal to
the engine without speculation, drafts both accepted and rejected, every draft the runner
proposed equal to the naive MTP run from scratch over the sequence's tokens at that step, MTP
weights updated under their checkpoint names; a checkpoint without MTP weights refuses the
method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from raylane.actors.engine import SamplingParams
from safetensors.torch import load_file, save_file

from tests.hf_reference import hf_model
from tests.tiny_models import make_qwen3_5, make_qwen3_next
from tests.unit.spec.helpers import Tap, make_loopy, spec_engine
from tests.unit.spec.test_linear_attention import echo_prompts
from tests.unit.spec.test_mtp import MTP, record_drafts
from tests.unit.spec.test_parity import assert_same

FULL = 2  # the tiny models' full-attention layer: the MTP block is built like it


def add_mtp(path: str, seed: int = 0, scale: float = 1.0) -> str:
    """Write an MTP module into the checkpoint at `path` (and `mtp_num_hidden_layers: 1` into
    its config): its block a noisy copy of the full-attention layer, `fc` passing the token's
    embedding through (plus noise, times `scale`), so its drafts often agree with the loopy
    model's next token and sometimes do not."""
    gen = torch.Generator().manual_seed(seed)
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(config))
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    noise = lambda t, s: t + scale * s * torch.randn(t.shape, generator=gen)  # noqa: E731
    prefix = f"model.layers.{FULL}."
    for name in [n for n in tensors if n.startswith(prefix)]:
        tensors["mtp.layers.0." + name.removeprefix(prefix)] = noise(tensors[name], 0.02)
    h = tensors["model.norm.weight"].shape[0]
    eye = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors["mtp.fc.weight"] = noise(eye, 0.02)
    tensors["mtp.pre_fc_norm_embedding.weight"] = noise(torch.zeros(h), 0.1)
    tensors["mtp.pre_fc_norm_hidden.weight"] = noise(torch.zeros(h), 0.1)
    tensors["mtp.norm.weight"] = noise(tensors["model.norm.weight"], 0.1)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def fuse_experts(tensors: dict) -> dict:
    """Per-expert checkpoint tensors -> HF's fused `experts.gate_up_proj` [E, 2I, H] (gate
    rows, then up) and `experts.down_proj` [E, H, I] (no experts: unchanged)."""
    names = sorted({n.split(".")[2] for n in tensors if n.startswith("mlp.experts.")}, key=int)
    if not names:
        return tensors
    out = {n: t for n, t in tensors.items() if not n.startswith("mlp.experts.")}
    part = lambda e, p: tensors[f"mlp.experts.{e}.{p}.weight"]  # noqa: E731
    gate_up = [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in names]
    out["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["mlp.experts.down_proj"] = torch.stack([part(e, "down_proj") for e in names])
    return out


class NaiveMtp:
    """The MTP module from the checkpoint's tensors: the norms and `fc` here, the block a
    Hugging Face decoder layer (a full-attention one) holding `mtp.layers.0.*`."""

    def __init__(self, path: str):
        self.hf = hf_model(path)
        self.w = load_file(str(Path(path) / "model.safetensors"))
        self.eps = self.hf.config.rms_norm_eps
        self.block = type(self.hf.model.layers[FULL])(self.hf.config, FULL)
        own = {n.removeprefix("mtp.layers.0."): t for n, t in self.w.items() if "mtp.layers." in n}
        self.block.load_state_dict(fuse_experts(own))
        self.block.eval()

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int = 1) -> tuple[int, ...]:
        """From scratch: the MTP module over the whole sequence (row p: the main model's
        hidden state at p, the embedding of token p + 1); the newest token's row gives draft 1
        through the main LM head (argmax). Chained: draft j's embedding and the MTP output
        (after `mtp.norm`) at the row before it make one more row, and the module runs again
        over every row (causal), the last row giving draft j + 1 (block 0 each time)."""
        hidden = self._main(tokens[:-1])[0][0]  # [m - 1, H], after the final norm
        inputs, drafts = list(tokens[1:]), []
        for _ in range(k):
            out = self._mtp(inputs, hidden)[-1]
            drafts.append(int(self.hf.lm_head(out).argmax()))
            inputs.append(drafts[-1])
            hidden = torch.cat([hidden, out.unsqueeze(0)])
        return tuple(drafts)

    def _main(self, ids: list[int]) -> tuple[torch.Tensor, dict]:
        """(the main model's last hidden state [1, T, H], the keyword arguments its
        full-attention layer got: rotary embeddings and causal mask for T positions)."""
        seen: dict = {}

        def grab(module, args, kwargs):
            seen.update(kwargs)

        handle = self.hf.model.layers[FULL].register_forward_pre_hook(grab, with_kwargs=True)
        hidden = self.hf.model(torch.tensor(ids).unsqueeze(0)).last_hidden_state
        handle.remove()
        keep = ("position_embeddings", "attention_mask", "position_ids")
        return hidden, {k: v for k, v in seen.items() if k in keep}

    def _mtp(self, inputs: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The module's rows [T, H] for tokens p + 1 (`inputs`) and hidden states [T, H]."""
        _, kwargs = self._main(inputs)  # (for T positions' rotary embeddings and mask)
        embeds = self.hf.model.embed_tokens(torch.tensor(inputs))
        w, eps = self.w, self.eps
        x = torch.cat(
            [rms(embeds, w["mtp.pre_fc_norm_embedding.weight"], eps),
             rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1,
        ) @ w["mtp.fc.weight"].T  # fmt: skip
        out = self.block(x.unsqueeze(0), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return rms(out[0], w["mtp.norm.weight"], eps)


@pytest.mark.parametrize(
    "make, options",
    [(make_qwen3_5, {}), (make_qwen3_next, {"async_scheduling": True, "num_kv_blocks": 7})],
    ids=["qwen3_5", "qwen3_next-async-tight"],
)
def test_mtp_drafts_and_greedy_parity(tmp_path, make, options):
    path = add_mtp(make_loopy(make(tmp_path / "model")))
    reference = spec_engine(path, None)
    prompts = echo_prompts(reference, count=2)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    ref = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()
    engine = spec_engine(path, MTP, max_num_batched_tokens=32, **options)
    seen, tap = record_drafts(engine), Tap(engine, 1)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    stats = engine.stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert tap.num_accepted == stats.spec_decode_num_accepted_tokens
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    # the MTP weights take updates under their checkpoint names
    before = engine.executor.collective_rpc("weight_checksums")[0]
    fc = load_file(str(Path(path) / "model.safetensors"))["mtp.fc.weight"]
    engine.update_weights([("mtp.fc.weight", fc * 0.5)])
    after = engine.executor.collective_rpc("weight_checksums")[0]
    assert [n for n in after if after[n] != before[n]] == ["mtp_layers.0.fc.weight"]
    engine.shutdown()
    naive = NaiveMtp(path)
    for tokens, drafts in seen[:: max(1, len(seen) // 6)]:  # a sample: HF runs from scratch
        assert drafts == naive.drafts(tokens)  # k = 1: one draft per plan


def test_mtp_needs_mtp_weights(tmp_path):
    plain = make_qwen3_5(tmp_path / "plain")  # transformers saved it: no MTP config or weights
    with pytest.raises(ValueError, match="speculative_config.method='mtp'"):
        spec_engine(plain, MTP)
    config_file = Path(plain) / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):  # named, but no weights
        spec_engine(plain, MTP)
