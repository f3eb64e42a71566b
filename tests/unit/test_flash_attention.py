"""The flash_attn backend without a GPU: selection and fallback with fake forks injected into
sys.modules, and the layout it hands the fork (block table, seqused_k, cu_seqlens_q, window,
scale, num_splits) checked through a fake that computes with the torch reference."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from raylane.kernels.attention import BackendRequest, SeqSlice, get_backend
from raylane.kernels.attention.builder import build_metadata
from raylane.kernels.attention.torch_ref import TorchAttention, attend

from tests.unit.flash_fakes import fake_fork_module, install, install_for_cpu_engine

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16
BF16 = BackendRequest(dtype=torch.bfloat16, head_sizes=(HEAD_DIM,), block_size=BLOCK)


def test_auto_picks_flash_attn_on_cuda_where_vllm_bundles_the_fork(monkeypatch):
    install(monkeypatch, vllm=fake_fork_module((2,)), standalone=fake_fork_module((2,)))
    backend = get_backend("auto", "cuda", ["full"], BF16)
    assert backend.name == "flash_attn"
    assert (backend.fork.module, backend.fork.fa_version) == ("vllm.vllm_flash_attn", 2)
    assert backend.num_splits == 0  # the kernel's own split heuristic


def test_hopper_takes_fa3_and_the_standalone_package_serves_alone(monkeypatch):
    install(monkeypatch, standalone=fake_fork_module((2, 3)), capability=(9, 0))
    backend = get_backend("FLASH_ATTN", "cuda", ["full", "sinks"], BF16)
    assert (backend.fork.module, backend.fork.fa_version) == ("vllm_flash_attn", 3)
    install(monkeypatch, standalone=fake_fork_module((2, 3)), capability=(8, 0))
    assert get_backend("auto", "cuda", ["full"], BF16).fork.fa_version == 2  # FA3 is Hopper's


def test_without_a_fork_auto_keeps_triton_and_a_forced_flash_attn_says_what_is_missing(
    monkeypatch,
):
    pytest.importorskip("triton")
    install(monkeypatch)
    assert get_backend("auto", "cuda", ["full"], BF16).name == "triton"
    with pytest.raises(ValueError, match="attention_backend") as e:
        get_backend("FLASH_ATTN", "cuda", ["full"], BF16)
    message = str(e.value)
    assert "vllm.vllm_flash_attn" in message and "vllm_flash_attn:" in message
    assert "No module named" in message or "import" in message
    assert "install vLLM's wheel" in message


def test_an_old_fork_that_reports_no_fa_version_is_not_used(monkeypatch):
    pytest.importorskip("triton")
    install(monkeypatch, standalone=fake_fork_module(reports_version=False))
    assert get_backend("auto", "cuda", ["full"], BF16).name == "triton"
    with pytest.raises(ValueError, match="reports no FA version"):
        get_backend("flash_attn", "cuda", ["full"], BF16)


def test_a_fork_whose_fa2_the_gpu_lacks_is_not_used(monkeypatch):
    install(monkeypatch, vllm=fake_fork_module(versions=()), capability=(7, 5))
    with pytest.raises(ValueError, match="FA2 is not supported on this device"):
        get_backend("FLASH_ATTN", "cuda", ["full"], BF16)


def test_flash_attn_never_runs_on_the_cpu(monkeypatch):
    install(monkeypatch, vllm=fake_fork_module((2,)))
    assert get_backend("auto", "cpu", ["full"], BF16).name in ("cpu", "torch")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("FLASH_ATTN", "cpu", ["full"], BF16)


@pytest.mark.parametrize(
    ("kinds", "request_", "why"),
    [
        (["full", "sinks"], BF16, "FA2 has no attention sinks"),
        (["full", "mla"], BF16, "keep their own paths"),
        (["full"], BackendRequest(dtype=torch.float32), "not float16 or bfloat16"),
        (["full"], BackendRequest(head_sizes=(64, 20)), "head sizes [20]"),
        (["full"], BackendRequest(block_size=8), "block_size 8"),
    ],
    ids=["sinks_on_fa2", "mla", "float32", "head_size", "block_size"],
)
def test_what_the_fork_cannot_serve_falls_back_to_triton_with_a_log_line(
    monkeypatch, caplog, kinds, request_, why
):
    pytest.importorskip("triton")
    install(monkeypatch, vllm=fake_fork_module((2,)))
    with caplog.at_level(logging.INFO, logger="raylane.kernels.attention.registry"):
        assert get_backend("auto", "cuda", kinds, request_).name == "triton"
    assert any("flash_attn" in r.message and why in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="flash_attn"):
        get_backend("FLASH_ATTN", "cuda", kinds, request_)  # forced: fails, names why
    assert get_backend("TRITON_ATTN", "cuda", kinds, request_).name == "triton"


def test_vllm_names_force_our_backends():
    assert get_backend("TORCH_SDPA", "cpu").name == "torch"
    with pytest.raises(ValueError, match="FLASH_ATTN"):  # the error lists vLLM's names too
        get_backend("NO_SUCH_ATTN", "cpu")


# --- the call it makes ------------------------------------------------------------------------

# (num_new, context_len): a fresh prefill, a chunk over cached context, two verify rows (3
# query tokens over context), decodes; in the runner's order (chunks, then one-token rows)
STEP = ([(7, 7), (5, 37), (3, 20), (3, 33)], [(1, 1), (1, 17), (1, 64)])


def make_step(seed: int, dtype=torch.float32):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    shapes = STEP[0] + STEP[1]
    need = [-(-ctx // BLOCK) for _, ctx in shapes]
    pool = list(range(sum(need) + 2))
    rng.shuffle(pool)  # non-contiguous block tables
    slices = []
    for (num_new, ctx), n in zip(shapes, need):
        slices.append(SeqSlice(num_new, ctx, pool[:n]))
        pool = pool[n:]
    tokens, slots = sum(n for n, _ in shapes), (sum(need) + 2) * BLOCK
    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    tensors = (
        rand(tokens, HEADS, HEAD_DIM),
        rand(tokens, KV_HEADS, HEAD_DIM),
        rand(tokens, KV_HEADS, HEAD_DIM),
        rand(slots, KV_HEADS, HEAD_DIM),  # the cached context
        rand(slots, KV_HEADS, HEAD_DIM),
    )
    split = len(STEP[0])
    return slices[:split], slices[split:], tensors


def run(backend, step, scale, **kw):
    prefills, decodes, tensors = step
    q, k, v, k_cache, v_cache = (t.clone() for t in tensors)
    meta = build_metadata(prefills, decodes, BLOCK)
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale, **kw), k_cache, meta


@pytest.mark.parametrize(
    ("window", "sinks", "softcap", "num_splits"),
    [(None, False, 0.0, 0), (6, False, 0.0, 1), (None, True, 0.0, 0), (9, True, 2.5, 1)],
    ids=["plain", "window_one_split", "sinks", "window_sinks_softcap"],
)
def test_the_fork_gets_vllms_paged_call_and_matches_the_torch_reference(
    monkeypatch, window, sinks, softcap, num_splits
):
    fork = fake_fork_module((2, 3))
    install(monkeypatch, vllm=fork, capability=(9, 0))
    kinds = ["full", "sliding", "sinks", "softcap"]
    request = BackendRequest(torch.bfloat16, (HEAD_DIM,), BLOCK, num_splits=num_splits)
    flash = get_backend("FLASH_ATTN", "cuda", kinds, request)
    step, scale = make_step(seed=3), 0.31
    kw = {"window": window, "softcap": softcap}
    kw["sinks"] = torch.linspace(-1.0, 2.0, HEADS) if sinks else None
    ref, ref_k, _ = run(TorchAttention(), step, scale, **kw)
    got, got_k, meta = run(flash, step, scale, **kw)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_k, ref_k)  # the step's K/V stored into the same slots
    (call,) = fork.calls
    assert call["block_table"] is meta.block_tables and call["seqused_k"] is meta.seq_lens
    assert call["cu_seqlens_q"] is meta.query_start_loc
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (meta.max_query_len, meta.max_seq_len)
    assert call["window_size"] == ((-1, -1) if window is None else (window - 1, 0))
    assert call["softmax_scale"] == scale and call["causal"] and call["softcap"] == softcap
    assert (call["num_splits"], call["fa_version"]) == (num_splits, 3)
    assert call["k"].shape == (ref_k.shape[0] // BLOCK, BLOCK, KV_HEADS, HEAD_DIM)
    assert call["k"].data_ptr() == got_k.data_ptr()  # a view of the cache, no copy


def test_fa2_gets_no_sinks_and_at_most_one_split(monkeypatch):
    fork = fake_fork_module((2,))
    install(monkeypatch, vllm=fork)
    request = BackendRequest(torch.bfloat16, (HEAD_DIM,), BLOCK, num_splits=1)
    flash = get_backend("FLASH_ATTN", "cuda", ["full", "sliding"], request)
    run(flash, make_step(seed=4), 0.25, window=5)  # the fake raises what FA2 raises
    assert fork.calls[0]["s_aux"] is None and fork.calls[0]["num_splits"] == 1


def test_torch_reference_softcap_is_cap_times_tanh():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=gen) * 3 for _ in range(3))
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    logits = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 4.0) * 4.0
    want = logits.masked_fill(~allowed, -torch.inf).softmax(-1) @ v
    torch.testing.assert_close(attend(q, k, v, allowed, 0.5, None, 4.0), want)


# --- the engine, on the CPU through the fake fork ---------------------------------------------


def test_engine_with_flash_attn_equals_torch_greedy_eager_and_replayed(monkeypatch, tiny_llama_dir):
    """The runner picks flash_attn by vLLM's name and runs prefill, decode and the graph
    runner's static decode metadata through it (on the CPU the graphs replay eagerly)."""
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

    fork = fake_fork_module((2,))
    install_for_cpu_engine(monkeypatch, fork)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for name, eager in (("torch", True), ("FLASH_ATTN", True), ("FLASH_ATTN", False)):
        engine = LLMEngine(
            EngineConfig(
                model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64, max_model_len=128,
                attention_backend=name, enforce_eager=eager, cudagraph_capture_sizes=(1, 2, 4),
            )
        )  # fmt: skip
        try:
            outs = engine.generate(prompts, params, use_tqdm=False)
            tokens[name, eager] = [o.outputs[0].token_ids for o in outs]
        finally:
            engine.shutdown()
    assert tokens["FLASH_ATTN", True] == tokens["FLASH_ATTN", False] == tokens["torch", True]
    assert any(c["max_seqlen_q"] == 1 and c["block_table"].shape[0] == 4 for c in fork.calls)


def test_engine_forced_flash_attn_without_the_fork_fails_at_start_up(monkeypatch, tiny_llama_dir):
    from raylane.actors.engine import EngineConfig, LLMEngine

    install(monkeypatch)
    with pytest.raises(ValueError, match="'flash_attn' is not available on cpu.*CUDA device"):
        LLMEngine(
            EngineConfig(model=tiny_llama_dir, num_kv_blocks=16, attention_backend="FLASH_ATTN")
        )
