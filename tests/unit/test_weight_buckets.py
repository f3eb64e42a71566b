"""Weight-update buckets: our safetensors writer and zero-copy reader against the `safetensors`
library (the independent reference), malformed payloads refused, and per-bucket re-packing of
oneDNN weights (a tied LM head included) against a model loaded unpacked from the same weights.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from raylane.actors.models import TPGroup, load_model, load_weights
from raylane.actors.models.packing import repack_changed
from raylane.actors.models.weights import (
    bucket_specs,
    decode_bucket,
    encode_bucket,
    iter_buckets,
    pack_bucket,
)
from raylane.actors.runner.weight_updates import RunnerWeights
from safetensors.torch import load, load_file, save

from tests.tiny_models import attach_kv_cache, make_llama, run_prefill


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 7, generator=gen),
        "b.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c.half": torch.randn(2, 3, 2, generator=gen).to(torch.float16),
        "d.strided": torch.randn(6, 4, generator=gen).t(),  # not contiguous
        "e.empty": torch.empty(0, 4),
    }


def test_our_bytes_load_with_the_safetensors_library():
    want = _tensors()
    got = load(encode_bucket(want.items()))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("as_array", [False, True])
def test_we_read_the_libraries_bytes_in_place(as_array):
    want = _tensors()
    payload = save({k: v.contiguous() for k, v in want.items()})
    if as_array:  # what a replica gets from the object store: a read-only uint8 array
        payload = np.frombuffer(payload, dtype=np.uint8)
    got = decode_bucket(payload)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert sorted(s.name for s in bucket_specs(payload)) == sorted(want)


def test_a_scratch_buffer_is_reused_when_large_enough():
    want = _tensors()
    scratch = np.zeros(1 << 12, dtype=np.uint8)
    packed = pack_bucket(want.items(), scratch)
    assert packed.base is scratch and packed.size < scratch.size
    assert torch.equal(load(packed.tobytes())["a.weight"], want["a.weight"])
    big = pack_bucket(want.items(), np.zeros(8, dtype=np.uint8))  # too small: fresh memory
    assert big.base is None and bytes(big) == bytes(packed)


def _payload(header: dict, body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"\x01\x00", "shorter"),
        (struct.pack("<Q", 99) + b"{}", "longer"),
        (struct.pack("<Q", 4) + b"nope", "bad header"),
        (struct.pack("<Q", 2) + b"[]", "bad header"),
        (
            _payload({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
            "dtype",
        ),
        (
            _payload({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)),
            "offsets",
        ),  # past the end of the body
        (
            _payload({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(16)),
            "offsets",
        ),  # fewer bytes than the shape needs
        (
            _payload({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, bytes(16)),
            "offsets",
        ),
        (
            _payload({"x": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, bytes(8)),
            "shape",
        ),
    ],
)
def test_a_malformed_payload_is_a_value_error(payload, says):
    with pytest.raises(ValueError, match=says):
        decode_bucket(payload)
    with pytest.raises(ValueError, match=says):
        bucket_specs(payload)


def _logits(model) -> torch.Tensor:
    attach_kv_cache(model, 48)
    return run_prefill(model, list(range(3, 45)))[0]


@pytest.mark.parametrize("tied", [False, True])
def test_buckets_repack_what_they_change(tmp_path, tied):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: nothing is packed")
    base = make_llama(tmp_path / "base", tie_word_embeddings=tied)
    other = make_llama(tmp_path / "other", seed=7, tie_word_embeddings=tied)
    model, _, _ = load_model(base, "float32")
    assert model.lm_head.packed is not None
    named = list(load_file(f"{other}/model.safetensors").items())
    # small buckets, so stacked weights (q/k/v, gate/up) span several of them
    for bucket in iter_buckets(named, 6_000):
        tensors = decode_bucket(encode_bucket(bucket))
        repack_changed(model, load_weights(model, tensors.items(), partial=True))
    fresh, _, _ = load_model(other, "float32", pack_weights=False)
    torch.testing.assert_close(_logits(model), _logits(fresh), atol=1e-5, rtol=0)
    before = model.model.layers[0].mlp.down_proj.packed
    assert repack_changed(model, {"model.layers.1.mlp.down_proj.weight"}) == 1
    assert model.model.layers[0].mlp.down_proj.packed is before  # untouched: not re-packed


def test_a_transaction_repacks_after_its_commit_and_on_rollback(tmp_path):
    """Loads inside a transaction drop the packs they change (F.linear serves those until the
    commit's re-pack on the loader thread); a rollback re-packs the old weights at once."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: nothing is packed")
    base = make_llama(tmp_path / "base")
    other = make_llama(tmp_path / "other", seed=7)
    model, hf_config, _ = load_model(base, "float32")
    weights = RunnerWeights(model, hf_config, TPGroup(), torch.device("cpu"))
    named = list(load_file(f"{other}/model.safetensors").items())
    specs = [(n, tuple(t.shape), "float32") for n, t in named]
    packable = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    base_logits = _logits(model)

    weights.check(specs)
    weights.load_bucket(dict(named))
    assert all(m.packed is None for m in packable)  # dropped, not yet rebuilt
    weights.rollback()
    assert all(m.packed is not None for m in packable)
    torch.testing.assert_close(_logits(model), base_logits, atol=1e-5, rtol=0)

    weights.check(specs)
    weights.load_bucket(dict(named))
    weights.finish()
    weights.settle()
    assert all(m.packed is not None for m in packable)
    fresh, _, _ = load_model(other, "float32", pack_weights=False)
    torch.testing.assert_close(_logits(model), _logits(fresh), atol=1e-5, rtol=0)
