"""The CPU LoRA kernel (kernels/lora.py) against a naive per-token loop in float64.

Each layer below has parts of sizes that are not multiples of the kernel's vector (its padding
in play), adapters of a smaller rank than the slots' (zero-padded, as LayerLoRA stores them),
tokens of a slot scattered through the batch in groups of unequal sizes, and base tokens,
whose rows must come back untouched. A slot no token runs holds NaN: reading it would show.
"""

from __future__ import annotations

import pytest
import torch
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from raylane.actors.lora import layer_lora
from raylane.actors.lora.layer_lora import LayerLoRA, LoRAStep
from raylane.actors.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)
from raylane.kernels.lora import LoRAKernelWeights, LoRATokens, lora_kernel

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.tiny_models import make_llama

KERNEL = lora_kernel()
if KERNEL is None:
    pytest.skip("the CPU LoRA kernel could not be built (no C compiler?)", allow_module_level=True)

MAX_RANK, RANK, IN = 24, 13, 37  # q/k/v: 72 shrink columns, two tiles
# float32 math, one rounding into y (bfloat16: at most its half ulp, 2^-9 relative)
_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
SLOTS = 4  # slot 3 holds NaN and no token runs it
# each token's slot (-1: base), groups of 5, 1 and 9 tokens mixed with base tokens
TOKEN_SLOTS = [0, -1, 2, 2, 0, 1, -1, 2, 0, 2, 2, 0, 2, -1, 2, 0, 2, 2, -1]


def _weights(parts: list[int], gen: torch.Generator, dtype: torch.dtype):
    """Per slot A [P * R, in], B [out, P * R]: each part's B block on its own ranks, ranks past
    RANK zero (as LayerLoRA pads them)."""
    width, out = len(parts) * MAX_RANK, sum(parts)
    a = torch.zeros(SLOTS, width, IN)
    b = torch.zeros(SLOTS, out, width)
    begin = 0
    for p, size in enumerate(parts):
        ranks = slice(p * MAX_RANK, p * MAX_RANK + RANK)
        a[:, ranks] = torch.randn(SLOTS, RANK, IN, generator=gen)
        b[:, begin : begin + size, ranks] = torch.randn(SLOTS, size, RANK, generator=gen)
        begin += size
    a[SLOTS - 1], b[SLOTS - 1] = float("nan"), float("nan")
    return a.to(dtype), b.to(dtype)


def _kernel_weights(parts: list[int], a: torch.Tensor, b: torch.Tensor) -> LoRAKernelWeights:
    ends = torch.tensor(parts).cumsum(0).tolist()
    weights = LoRAKernelWeights(SLOTS, MAX_RANK, IN, ends, a.dtype)
    for slot in range(SLOTS):
        weights.write(slot, a[slot], b[slot])
    return weights


def _sorted(slots: list[int]) -> LoRATokens:
    order = sorted((s, t) for t, s in enumerate(slots) if s >= 0)
    return LoRATokens([t for _, t in order], [s for s, _ in order])


def _reference(x, y, a, b, slots: list[int]) -> torch.Tensor:
    """float64, token by token: y[t] + x[t] @ A_s^T @ B_s^T."""
    ref = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            ref[t] += x[t].double() @ a[s].double().T @ b[s].double().T
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [[40, 24, 24], [48, 48], [33], [130]])
def test_matches_a_per_token_loop(dtype: torch.dtype, parts: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(parts))
    a, b = _weights(parts, gen, dtype)
    weights = _kernel_weights(parts, a, b)
    t = len(TOKEN_SLOTS)
    x = torch.randn(t, IN, generator=gen).to(dtype)
    y = torch.randn(t, sum(parts), generator=gen).to(dtype)
    got = y.clone()
    KERNEL.add(x, got, _sorted(TOKEN_SLOTS), weights)
    ref = _reference(x, y, a, b, TOKEN_SLOTS)
    base = [i for i, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])  # base rows: bit for bit untouched
    torch.testing.assert_close(got.double(), ref, rtol=_TOL[dtype], atol=_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_result_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Bit for bit, a token alone and in a batch of 200 (which takes the threaded path)."""
    parts = [40, 24, 24]
    gen = torch.Generator().manual_seed(3)
    a, b = _weights(parts, gen, dtype)
    weights = _kernel_weights(parts, a, b)
    slots = [(t * 7) % 4 - 1 for t in range(200)]
    x = torch.randn(200, IN, generator=gen).to(dtype)
    y = torch.randn(200, sum(parts), generator=gen).to(dtype)
    batch = y.clone()
    KERNEL.add(x, batch, _sorted(slots), weights)
    ref = _reference(x, y, a, b, slots)
    torch.testing.assert_close(batch.double(), ref, rtol=_TOL[dtype], atol=_TOL[dtype])
    for t in (0, 5, 101, 199):
        alone = y[t : t + 1].clone()
        KERNEL.add(x[t : t + 1], alone, _sorted(slots[t : t + 1]), weights)
        assert torch.equal(alone[0], batch[t]), t


def test_layer_lora_runs_the_kernel_on_a_fused_layer() -> None:
    """Through LayerLoRA (PEFT weights -> its buffers -> the kernel's layout): rows of two
    adapters and a base row equal plain torch's x @ A^T @ B^T * scaling per part."""
    gen = torch.Generator().manual_seed(4)
    hidden, head_dim, heads, kv_heads, scale = 32, 8, 4, 2, 0.5
    layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
    step = LoRAStep()
    lora = LayerLoRA(layer, 2, MAX_RANK, step)
    assert lora.kernel is not None
    sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    adapters = []
    for slot in range(2):
        parts = {
            p: (torch.randn(RANK, hidden, generator=gen), torch.randn(n, RANK, generator=gen))
            for p, n in sizes.items()
        }
        lora.write(slot, lora.prepare(parts, scale))
        adapters.append(parts)
    x = torch.randn(3, hidden, generator=gen)
    y = torch.randn(3, layer.weight.shape[0], generator=gen)
    step.set_eager(LoRATokens([2, 0], [0, 1]), None)  # token 0 on slot 1, 1 base, 2 on slot 0
    got = lora.add(x, y.clone())
    for t, slot in ((0, 1), (2, 0)):
        delta = torch.cat([x[t] @ a.T @ b.T * scale for a, b in adapters[slot].values()])
        torch.testing.assert_close(got[t], y[t] + delta, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y[1])


_TP_LAYERS = {  # this rank's slice of a layer, 2 ranks
    "qkv, KV heads replicated": lambda: QKVParallelLinear(32, 8, 4, 1, tp=TPGroup(1, 2)),
    "gate/up": lambda: MergedColumnParallelLinear(32, [24, 24], tp=TPGroup(1, 2)),
    "row": lambda: RowParallelLinear(48, 32, tp=TPGroup(1, 2)),
}


@pytest.mark.parametrize("make", _TP_LAYERS.values(), ids=_TP_LAYERS.keys())
def test_tensor_parallel_slices_read_their_own_parts(make) -> None:
    """A rank's slice (parts of other sizes, B rows or A columns split through the layer's
    loader) in the kernel's layout: each row equals its slot's x @ A^T @ B^T from the layer's
    dense buffers (which test_lora_tp_slices checks against the whole adapter)."""
    gen = torch.Generator().manual_seed(5)
    layer = make()
    lora = LayerLoRA(layer, 2, MAX_RANK, LoRAStep())
    out, inp = layer.weight.shape
    full_in = inp * (2 if isinstance(layer, RowParallelLinear) else 1)
    for slot in range(2):
        parts = {}
        for shard_id, size in zip(lora.parts, _full_sizes(layer)):
            parts[shard_id] = (
                torch.randn(RANK, full_in, generator=gen),
                torch.randn(size, RANK, generator=gen),
            )
        lora.write(slot, lora.prepare(parts, 0.5))
    x = torch.randn(4, inp, generator=gen)
    y = torch.randn(4, out, generator=gen)
    slots = [1, -1, 0, 1]
    lora.step.set_eager(_sorted(slots), None)
    got = lora.add(x, y.clone())
    ref = _reference(x, y, lora.a, lora.b, slots)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _full_sizes(layer) -> list[int]:
    """The whole (unsplit) output size of each part."""
    if isinstance(layer, QKVParallelLinear):
        return [4 * 8, 1 * 8, 1 * 8]
    if isinstance(layer, MergedColumnParallelLinear):
        return [24, 24]
    return [layer.weight.shape[0]]


def test_torch_path_where_the_kernel_did_not_build(tmp_path, monkeypatch) -> None:
    """Without the C kernel (a machine with no compiler; CUDA's eager path) the torch path
    serves: a batch of two adapters' rows, non-adjacent, and a base row equals PEFT."""
    monkeypatch.setattr(layer_lora, "lora_kernel", lambda: None)
    base = make_llama(tmp_path / "base")
    adapters = {n: make_adapter(base, tmp_path / n, seed=i + 1) for i, n in enumerate(["a", "b"])}
    prompts, names = (
        [[5, 17, 33, 8], [9, 10, 11], [40, 41, 42, 7, 7], [7, 8, 9]],
        ["a", None, "b", "a"],
    )
    requests = [None if n is None else LoRARequest(n, 1 + (n == "b"), adapters[n]) for n in names]
    engine = LLMEngine(EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=4))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
        outs = engine.generate(prompts, params, False, requests)
    finally:
        engine.shutdown()
    ref = peft_models(base, adapters)
    for out, name, prompt in zip(outs, names, prompts):
        tokens, logprobs = peft_greedy(ref, name, prompt, 6)
        assert out.outputs[0].token_ids == tokens, name
        assert out.outputs[0].logprobs == pytest.approx(logprobs, abs=1e-4)
