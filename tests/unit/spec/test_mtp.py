"""MTP drafts (method "mtp") on a tiny DeepSeek-V3 with one MTP layer: greedy output and
logprobs identical to the engine without speculation, and every draft the runner proposed
equal to Hugging Face's own MtpLayer run from scratch over the sequence's tokens at that
point (so the MTP layer's cache rows, written step by step and over rejected drafts, hold
what a full recomputation gives)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from raylane.actors.engine import SamplingParams

from tests.unit.spec.helpers import Tap, spec_engine
from tests.unit.spec.test_parity import assert_same
from tests.unit.test_mtp_layers import make_deepseek_v3_with_mtp

MTP = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return make_deepseek_v3_with_mtp(tmp_path_factory.mktemp("ds_mtp"))


def record_drafts(engine) -> list[tuple[list[int], tuple[int, ...]]]:
    """(the sequence's tokens when a plan carried its drafts, the drafts), from each plan."""
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    submit = engine.executor.submit

    def tapped(plan):
        running = {seq.seq_id: seq for seq in engine.scheduler.running}
        for seq_id, drafts in plan.draft_token_ids:
            seen.append((list(running[seq_id].token_ids), drafts))
        return submit(plan)

    engine.executor.submit = tapped
    return seen


@torch.inference_mode()
def hf_mtp_drafts(main, mtp, tokens: list[int], k: int) -> tuple[int, ...]:
    """HF, from scratch: the MTP layer over the whole sequence (row p: the main model's
    hidden state at p, the embedding of token p + 1); its row of the newest token gives draft
    1 through the main model's LM head. Chained: draft j's embedding and the MTP output at
    the row before it make one more row, and the layer runs again over every row (causal),
    the last row giving draft j + 1 (the one layer reused, as vLLM and SGLang do)."""
    ids = torch.tensor(tokens)
    hidden = main.model(ids[:-1].unsqueeze(0)).last_hidden_state[0]  # [m - 1, H]
    inputs = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(k):
        rows = len(inputs)
        embeds = main.model.embed_tokens(torch.tensor(inputs)).unsqueeze(0)
        position_ids = torch.arange(rows).unsqueeze(0)
        cos_sin = main.model.rotary_emb(embeds, position_ids)
        mask = torch.full((rows, rows), float("-inf")).triu(1).view(1, 1, rows, rows)
        out = mtp.layers[0](embeds, hidden.unsqueeze(0), cos_sin, mask, position_ids, cache=None)
        last = out[0].reshape(rows, -1)[-1]
        drafts.append(int(main.lm_head(last).argmax()))
        inputs.append(drafts[-1])
        hidden = torch.cat([hidden, last.unsqueeze(0)])
    return tuple(drafts)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_parity_and_drafts_against_hf(mtp_model, k):
    """k = 3 chains two more MTP steps on the checkpoint's one layer; a tight KV pool (18
    blocks for 47 + 16 tokens) leaves some rows without the chain's reserved slots."""
    path, main, mtp = mtp_model
    prompts = [list(range(5, 5 + n)) for n in (7, 20, 47)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    reference = spec_engine(path, None)
    ref = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()
    spec = {**MTP, "num_speculative_tokens": k}
    engine = spec_engine(path, spec, max_num_batched_tokens=16, num_kv_blocks=18)
    seen = record_drafts(engine)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    assert len(seen) > 4
    if k > 1:
        assert max(len(d) for _, d in seen) == k
    # random MTP weights: the drafts are rejected (the accepted path: test_mtp_accepted_drafts)
    for tokens, drafts in seen:
        assert drafts == hf_mtp_drafts(main, mtp, tokens, len(drafts))
    engine.shutdown()


def test_mtp_needs_mtp_layers(tiny_deepseek_dir):
    with pytest.raises(ValueError, match="speculative_config.method='mtp'"):
        spec_engine(tiny_deepseek_dir, MTP)  # HF-saved: no MTP weights, the layers dropped


def biased_copy(path: str, out: str, token: int = 7) -> str:
    """The MTP model with a residual dimension that stays large (embedding column 0, and the
    MTP layer's input row 0 reading the hidden state's) and an LM head row that reads it:
    the main model's and the MTP layer's argmax is often `token`, so MTP drafts get accepted
    (random MTP weights' drafts almost never are)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    file = f"{out}/model.safetensors"
    tensors = load_file(file)
    layers = sum(1 for n in tensors if n.endswith("input_layernorm.weight")) - 1
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors["model.embed_tokens.weight"][:, 0] = 10.0
    tensors["lm_head.weight"][token, 0] = 9.0
    tensors[f"model.layers.{layers}.eh_proj.weight"][0, hidden] = 200.0  # hnorm's column 0
    save_file(tensors, file, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    ("options", "k"),
    [
        ({}, 1),
        ({"async_scheduling": True}, 1),
        ({"num_kv_blocks": 4}, 1),
        ({}, 3),
        ({"async_scheduling": True}, 3),
        ({"num_kv_blocks": 3}, 3),
    ],
    ids=["serial", "async", "preemption", "k3-serial", "k3-async", "k3-preemption"],
)
def test_mtp_accepted_drafts(mtp_model, tmp_path, options, k):
    path = biased_copy(mtp_model[0], str(tmp_path / "biased"))
    prompts = [list(range(5, 5 + n)) for n in (7, 20)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    reference = spec_engine(path, None)
    ref = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()
    engine = spec_engine(path, {**MTP, "num_speculative_tokens": k}, **options)
    tap = Tap(engine, k)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    assert len({t for o in ref for t in o.outputs[0].token_ids}) > 2  # not one token repeated
    stats = engine.stats
    assert 0 < tap.num_accepted == stats.spec_decode_num_accepted_tokens
    assert tap.num_draft_tokens == stats.spec_decode_num_draft_tokens
    assert tap.per_pos == stats.spec_decode_num_accepted_tokens_per_pos
    if k > 1:
        assert tap.per_pos[1] > 0  # chained drafts accepted too
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    engine.shutdown()


def mtp_sampled_check(path: str, n: int = 600, k: int = 1) -> tuple[float, int, Tap]:
    """(chi-square p-value, dof, Tap) of the first 3 tokens of n unseeded draws with k MTP
    drafts per step against HF's forward of the model (2 + k tokens are drawn, so the first
    verify step can take k drafts)."""
    from tests.unit.spec.helpers import chi_square_p_value, hf_probability

    prompt = list(range(5, 12))
    engine = spec_engine(path, {**MTP, "num_speculative_tokens": k}, max_num_seqs=128)
    tap = Tap(engine, k)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2 + k, ignore_eos=True)
    outs = engine.generate([prompt] * n, params, use_tqdm=False)
    engine.shutdown()
    observed = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    probs = hf_probability(path, prompt, list(observed), 1.0, 3)
    return (*chi_square_p_value(observed, probs, n), tap)


def test_mtp_sampled_drafts(mtp_model, tmp_path, monkeypatch):
    """Sampled requests: unseeded ones' MTP drafts, drawn from q on the runner, are verified
    by min(1, p/q) against the q kept for them (chi-square of 3-token draws against HF's
    forward); seeded ones' tokens are the non-speculative ones."""
    from raylane.kernels import sampling

    path = biased_copy(mtp_model[0], str(tmp_path / "biased"))
    verified = []

    def counting(p, q, draft, *words):
        verified.append(len(draft))
        return accept(p, q, draft, *words)

    accept = sampling.speculative_accept
    monkeypatch.setattr(sampling, "speculative_accept", counting)
    p_value, dof, tap = mtp_sampled_check(path)
    assert sum(verified) == tap.num_draft_tokens > 300  # every draft verified by p/q
    assert 0 < tap.num_accepted < tap.num_draft_tokens
    assert dof >= 8 and p_value > 1e-3, (p_value, dof)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = [list(range(5, 12)), list(range(5, 25))]
    engine = spec_engine(path, MTP)
    got = engine.generate(prompts, seeded, use_tqdm=False)
    engine.shutdown()
    reference = spec_engine(path, None)
    assert_same(reference.generate(prompts, seeded, use_tqdm=False), got)
    reference.shutdown()


def test_chained_mtp_sampled_drafts(mtp_model, tmp_path):
    """Unseeded sampled requests with 2 chained MTP drafts per step: each drawn from its
    step's q, verified by min(1, p/q) against it; 3-token draws follow HF's forward."""
    path = biased_copy(mtp_model[0], str(tmp_path / "biased"))
    p_value, dof, tap = mtp_sampled_check(path, k=2)
    assert tap.per_pos[1] > 0 and tap.num_accepted < tap.num_draft_tokens
    assert dof >= 8 and p_value > 1e-3, (p_value, dof)
