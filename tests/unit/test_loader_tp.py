"""Tensor-parallel loading: every rank holds exactly its slice of the checkpoint and reads only
that slice. Expected slices come from the raw checkpoint (read with safetensors) by plain torch
indexing, never from our loaders; no process group is needed to load (TPGroup(group=None))."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from raylane.actors.models import LazyTensor, ReadStats, TPGroup, load_model
from raylane.actors.models.layers import copy_checked
from raylane.actors.models.loader import iter_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from tests.tiny_models import make_llama

VOCAB = 389  # not divisible by 2, 3, 4 or 6: the last rank's vocab rows are zero padding
# replicated on every rank: norms, the MoE router, row-parallel biases (added after the reduce)
_WHOLE = ("norm.weight", "mlp.gate.weight", "o_proj.bias", "down_proj.bias")


@pytest.fixture(scope="module")
def gqa_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 heads / 2 KV heads: tp=2 splits the KV heads, tp=4 replicates them; untied."""
    return make_llama(tmp_path_factory.mktemp("tp_llama"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def biased_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """6 heads / 3 KV heads with q/k/v/o and MLP biases, tied embeddings: tp 3 and 6."""
    return make_llama(
        tmp_path_factory.mktemp("tp_llama_b"),
        vocab_size=VOCAB,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=96,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    )


def _raw(model_dir: str) -> dict[str, torch.Tensor]:
    """The whole checkpoint, read independently of our loader."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    n = t.shape[dim] // parts
    return t[index * n : (index + 1) * n] if dim == 0 else t[:, index * n : (index + 1) * n]


def _vocab_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    per = -(-t.shape[0] // tp)
    rows = t[rank * per : (rank + 1) * per]
    return torch.cat([rows, rows.new_zeros(per - rows.shape[0], t.shape[1])])


def _qkv(
    raw: dict[str, torch.Tensor], stem: str, kind: str, config, rank: int, tp: int
) -> torch.Tensor:
    kv = config.num_key_value_heads
    # KV heads split over ranks, or (tp > kv) each head shared by tp // kv consecutive ranks
    kv_index, kv_parts = (rank, tp) if kv >= tp else (rank * kv // tp, kv)
    return torch.cat(
        [
            _part(raw[f"{stem}.q_proj.{kind}"], 0, rank, tp),
            _part(raw[f"{stem}.k_proj.{kind}"], 0, kv_index, kv_parts),
            _part(raw[f"{stem}.v_proj.{kind}"], 0, kv_index, kv_parts),
        ]
    )


def _experts(
    raw: dict[str, torch.Tensor], stem: str, which: str, config, rank: int, tp: int
) -> torch.Tensor:
    e = range(config.num_experts)
    if which == "w2_weight":  # down [H, I]: columns of this rank
        return torch.stack([_part(raw[f"{stem}.{i}.down_proj.weight"], 1, rank, tp) for i in e])
    return torch.stack(
        [
            torch.cat(
                [
                    _part(raw[f"{stem}.{i}.gate_proj.weight"], 0, rank, tp),
                    _part(raw[f"{stem}.{i}.up_proj.weight"], 0, rank, tp),
                ]
            )
            for i in e
        ]
    )


def _expected(name: str, raw: dict[str, torch.Tensor], config, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s value of our parameter `name`, from the raw checkpoint tensors."""
    stem, kind = name.rsplit(".", 1)
    module = stem.rsplit(".", 1)[-1]
    if module == "qkv_proj":
        return _qkv(raw, stem.removesuffix(".qkv_proj"), kind, config, rank, tp)
    if module == "gate_up_proj":
        mlp = stem.removesuffix(".gate_up_proj")
        parts = [raw[f"{mlp}.{p}_proj.{kind}"] for p in ("gate", "up")]
        return torch.cat([_part(t, 0, rank, tp) for t in parts])
    if module == "experts":
        return _experts(raw, stem, kind, config, rank, tp)
    if name.endswith(_WHOLE):
        return raw[name]
    if module in ("o_proj", "down_proj"):  # row-parallel: input columns
        return _part(raw[name], 1, rank, tp)
    if module in ("embed_tokens", "lm_head"):
        return _vocab_rows(raw[name], rank, tp)
    raise AssertionError(f"test does not know how {name} is split")


def _expected_bytes(expected: dict[str, torch.Tensor], config, rank: int, tp: int) -> int:
    """Bytes of the slices a rank needs: its parameters, minus the vocab padding rows."""
    per = -(-config.vocab_size // tp)
    pad = per - max(0, min(per, config.vocab_size - rank * per))
    vocab = [n for n in expected if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    itemsize = next(iter(expected.values())).element_size()
    return sum(map(_nbytes, expected.values())) - pad * config.hidden_size * len(vocab) * itemsize


def _sum_over_ranks(raw: dict[str, torch.Tensor], config, tp: int) -> int:
    """All ranks together read the checkpoint once, replicated tensors once per rank."""
    total = sum(map(_nbytes, raw.values()))
    whole = sum(_nbytes(t) for n, t in raw.items() if n.endswith(_WHOLE))
    kv = [t for n, t in raw.items() if ".k_proj." in n or ".v_proj." in n]
    kv_copies = max(1, tp // config.num_key_value_heads)  # ranks sharing each KV head
    return total + (tp - 1) * whole + (kv_copies - 1) * sum(map(_nbytes, kv))


def _check_all_ranks(model_dir: str, tp: int) -> list[int]:
    """Load every rank; each parameter equals its expected slice; each rank's bytes read equal
    the slices it needs. Returns the bytes read per rank."""
    raw = _raw(model_dir)
    read = []
    for rank in range(tp):
        stats = ReadStats()
        model, config, _ = load_model(
            model_dir,
            "float32",
            "cpu",
            tp=TPGroup(rank, tp, None),
            pack_weights=False,
            read_stats=stats,
        )
        params = dict(model.named_parameters())
        expected = {n: _expected(n, raw, config, rank, tp) for n in params}
        for name, param in params.items():
            assert param.dtype == torch.float32
            assert torch.equal(param.data, expected[name].float()), (name, rank)
        assert stats.bytes_read == _expected_bytes(expected, config, rank, tp), rank
        read.append(stats.bytes_read)
    assert sum(read) == _sum_over_ranks(raw, config, tp)
    total = sum(map(_nbytes, raw.values()))
    assert all(r < total / tp * 1.25 for r in read), (read, total)  # ~1/tp of the model
    return read


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gqa_llama_ranks_hold_their_slices(gqa_llama_dir, tp):
    _check_all_ranks(gqa_llama_dir, tp)


@pytest.mark.parametrize("tp", [3, 6])
def test_biased_tied_llama_ranks_hold_their_slices(biased_llama_dir, tp):
    _check_all_ranks(biased_llama_dir, tp)
    model, _, _ = load_model(
        biased_llama_dir, "float32", tp=TPGroup(tp - 1, tp), pack_weights=False
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("tp", [2, 4])
def test_moe_experts_split_along_intermediate(tiny_moe_dir, tp):
    _check_all_ranks(tiny_moe_dir, tp)


def test_tp1_reads_the_whole_checkpoint_once(tiny_moe_dir):
    stats = ReadStats()
    load_model(tiny_moe_dir, "float32", read_stats=stats)
    assert stats.bytes_read == sum(map(_nbytes, _raw(tiny_moe_dir).values()))


@pytest.mark.slow
def test_smollm2_tp3_ranks_read_a_third(smollm2_dir):
    read = _check_all_ranks(smollm2_dir, 3)  # 9 heads / 3 KV heads, tied embeddings
    assert len(set(read)) == 1  # vocab 49152 splits evenly


def _copy_dir(src: str, dst: Path, weights: dict[str, torch.Tensor], bin_file: bool) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    if bin_file:
        torch.save(weights, dst / "pytorch_model.bin")
    else:
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_bfloat16_checkpoint_is_cast_and_read_at_half_the_bytes(gqa_llama_dir, tmp_path):
    raw = {n: t.to(torch.bfloat16) for n, t in _raw(gqa_llama_dir).items()}
    bf16_dir = _copy_dir(gqa_llama_dir, tmp_path / "bf16", raw, bin_file=False)
    read_bf16, read_f32 = _check_all_ranks(bf16_dir, 2), _check_all_ranks(gqa_llama_dir, 2)
    assert [2 * r for r in read_bf16] == read_f32


def test_bin_fallback_loads_slices_but_reads_whole_tensors(gqa_llama_dir, tmp_path):
    raw = _raw(gqa_llama_dir)
    bin_dir = _copy_dir(gqa_llama_dir, tmp_path / "bin", raw, bin_file=True)
    assert all(isinstance(t, torch.Tensor) for _, t in iter_checkpoint(bin_dir))
    stats = ReadStats()
    model, config, _ = load_model(
        bin_dir, "float32", tp=TPGroup(1, 2), pack_weights=False, read_stats=stats
    )
    for name, param in model.named_parameters():
        assert torch.equal(param.data, _expected(name, raw, config, 1, 2)), name
    assert stats.bytes_read == sum(map(_nbytes, raw.values()))


# --- LazyTensor itself ---------------------------------------------------------------------


@pytest.fixture
def lazy_file(tmp_path) -> tuple[str, torch.Tensor]:
    full = torch.arange(6 * 8 * 2, dtype=torch.float32).reshape(6, 8, 2)
    path = tmp_path / "t.safetensors"
    save_file({"t": full, "s": torch.tensor(7.0)}, str(path))
    return str(path), full


def _view(path: str, stats: ReadStats, name: str = "t") -> LazyTensor:
    with safe_open(path, framework="pt") as f:
        return LazyTensor(f.get_slice(name), stats)


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(None, 4)),
        2,
        (Ellipsis, 1),
        (-1, slice(2, None)),
        (slice(1, 3), 5, 0),
        (slice(4, 4),),
        Ellipsis,
    ],
)
def test_lazy_indexing_matches_torch_and_reads_only_the_view(lazy_file, index):
    path, full = lazy_file
    stats = ReadStats()
    view = _view(path, stats)[index]
    assert view.shape == full[index].shape and view.dim() == full[index].dim()
    assert stats.bytes_read == 0  # nothing read until materialised
    assert torch.equal(view.materialize(), full[index])
    assert stats.bytes_read == full[index].numel() * 4


def test_lazy_narrow_chains_and_materialize(lazy_file):
    path, full = lazy_file
    stats = ReadStats()
    lazy = _view(path, stats)
    assert lazy.dtype == torch.float32 and tuple(lazy.shape) == (6, 8, 2)
    view = lazy[:, 2:].narrow(1, 1, 3).narrow(0, -2, 2)
    assert torch.equal(view.materialize(), full[:, 2:].narrow(1, 1, 3).narrow(0, -2, 2))
    gate, up = lazy[:3].narrow(1, 0, 4), lazy[3:].narrow(1, 0, 4)
    stats.bytes_read = 0
    joined = torch.cat([gate.materialize(), up.materialize()], dim=1)
    assert torch.equal(joined, torch.cat([full[:3, :4], full[3:, :4]], 1))
    assert stats.bytes_read == 2 * 3 * 4 * 2 * 4
    with pytest.raises(TypeError):
        torch.cat([gate, up])  # not a tensor: reading must be explicit
    with pytest.raises(ValueError, match=r"shape \(6, 8, 2\)"):
        lazy.narrow(0, 4, 3)
    scalar = _view(path, stats, "s")
    assert scalar.dim() == 0 and scalar.materialize().item() == 7.0


def test_copy_checked_reads_nothing_on_a_shape_mismatch(lazy_file):
    path, full = lazy_file
    stats = ReadStats()
    dst = torch.empty(3, 8, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        copy_checked(dst, _view(path, stats).narrow(0, 0, 2), "w")
    assert stats.bytes_read == 0
    copy_checked(dst, _view(path, stats).narrow(0, 3, 3), "w")
    assert torch.equal(dst, full[3:].to(torch.bfloat16)) and stats.bytes_read == 3 * 8 * 2 * 4


def test_checkpoint_views_stay_readable_after_iteration(gqa_llama_dir):
    raw = _raw(gqa_llama_dir)
    views = dict(iter_checkpoint(gqa_llama_dir))  # every file handle closed by now
    assert all(isinstance(v, LazyTensor) for v in views.values())
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(views[name][:, 5:9].materialize(), raw[name][:, 5:9])


def test_bad_tp_fails_before_building(gqa_llama_dir):
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"
    ):
        load_model(gqa_llama_dir, "float32", tp=TPGroup(0, 3))


def test_fused_3d_expert_layout_reads_the_same_slices(tiny_moe_dir, tmp_path):
    """transformers 5's gate_up_proj [E, 2I, H] / down_proj [E, H, I] load per rank like the
    per-expert layout, reading the same bytes (gate and up halves narrowed separately)."""
    raw = _raw(tiny_moe_dir)
    fused = dict(raw)
    for layer in (1, 3):
        stem, experts = f"model.layers.{layer}.mlp.experts", range(8)
        gate = torch.stack([fused.pop(f"{stem}.{e}.gate_proj.weight") for e in experts])
        up = torch.stack([fused.pop(f"{stem}.{e}.up_proj.weight") for e in experts])
        fused[f"{stem}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{stem}.down_proj"] = torch.stack(
            [fused.pop(f"{stem}.{e}.down_proj.weight") for e in experts]
        )
    fused_dir = _copy_dir(tiny_moe_dir, tmp_path / "fused", fused, bin_file=False)
    for rank in range(2):
        stats_a, stats_b = ReadStats(), ReadStats()
        a, _, _ = load_model(
            tiny_moe_dir, "float32", tp=TPGroup(rank, 2), pack_weights=False, read_stats=stats_a
        )
        b, _, _ = load_model(
            fused_dir, "float32", tp=TPGroup(rank, 2), pack_weights=False, read_stats=stats_b
        )
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert stats_a.bytes_read == stats_b.bytes_read
