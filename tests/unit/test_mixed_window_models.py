"""Models mixing sliding and full layers through the engine, with a block table per KV cache
group: tokens and logprobs equal Hugging Face's while the sliding groups hold O(window) blocks
and the full group O(length); the prefix cache, preemption, async scheduling, the graph
runner's eager replay and speculative decoding all give the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_reference import perturbed_model
from tests.tiny_models import make_gemma3, make_gpt_oss
from tests.unit.spec.helpers import make_echo
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for
from tests.unit.test_windowed_models import assert_routing_matches_hf

BLOCK, WINDOW, CHUNK, MAX_NEW, K = 4, 8, 16, 48, 3
SLIDING, FULL = "sliding_attention", "full_attention"


def mixed_engine(model_dir: str, **kw):
    kw = {"block_size": BLOCK, "max_num_batched_tokens": CHUNK, "num_kv_blocks": 64, **kw}
    return engine_for(model_dir, **kw)


def generate_counting_blocks(engine, prompts, params):
    """Outputs, and per allocation the blocks the sequence holds: (group 0, each sliding
    group after it, the tokens they cover); a full group after the first holds what it does."""
    blocks = engine.block_manager
    held: list[tuple[int, tuple[int, ...], int]] = []
    allocate = blocks.allocate

    def allocate_and_count(seq, num_new):
        assert_window_held(blocks, seq)
        allocate(seq, num_new)
        tables = zip(blocks.windows[1:], seq.group_tables, seq.group_released)
        live = len(seq.block_table) - seq.num_released_blocks
        held_by = [(window, len(table) - released) for window, table, released in tables]
        assert all(n == live for window, n in held_by if window is None)
        sliding = tuple(n for window, n in held_by if window is not None)
        held.append((live, sliding, seq.num_computed_tokens + num_new))

    blocks.allocate = allocate_and_count
    try:
        return engine.generate(prompts, params, use_tqdm=False), held
    finally:
        blocks.allocate = allocate


def assert_window_held(blocks, seq) -> None:
    """Every block the sequence's next query (at its computed count: a verify row's first)
    sees is still held: from the one holding the earliest position a sliding layer attends
    to (window - 1 back) through the last computed one."""
    at = seq.num_computed_tokens
    tables = [(blocks.windows[0], seq.block_table, seq.num_released_blocks)]
    tables += list(zip(blocks.windows[1:], seq.group_tables, seq.group_released))
    for window, table, released in tables:
        first = 0 if window is None else max(0, at - window + 1) // BLOCK
        assert released <= first
        assert all(blocks.blocks[b].ref_count > 0 for b in table[first : -(-at // BLOCK)])


def assert_o_window(held, num_sliding_groups: int, drafts: int = 0) -> None:
    """Full group: every block of the sequence (at least); sliding groups: the window (2
    blocks), one of slack, the block written and a chunk's reach (4 blocks) at most, once
    decoding 4, or with `drafts` per step the blocks from the window's start (9 positions back,
    the slack included) to the last draft: ceil((9 + drafts) / 4) + 1."""
    for full, sliding, length in held:
        assert full >= -(-length // BLOCK) and len(sliding) == num_sliding_groups
        assert max(sliding) <= 2 + 1 + 1 + CHUNK // BLOCK
    decoding = [max(sliding) for _, sliding, length in held if length > 40]
    assert decoding and max(decoding) <= -(-(WINDOW + 1 + drafts) // BLOCK) + 1


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_gpt_oss(tmp_path_factory.mktemp("mixed_gpt_oss"))  # sliding 8, full: 1:1


@pytest.fixture(scope="module")
def gpt_oss_ref(gpt_oss_dir: str):
    """Prompts longer than the window and a chunk, greedy to 81 and 97 tokens, scheduled
    serially: the engine equals HF and its routing too, in fewer blocks than the tables would
    hold unfreed."""
    engine = mixed_engine(gpt_oss_dir, enable_return_routed_experts=True, async_scheduling=False)
    assert engine.block_manager.windows == (None, WINDOW)
    assert engine.runner_info.kv_bytes_per_token == kv_bytes_per_layer(gpt_oss_dir)  # 1 of 2
    prompts = prompts_for(engine.validator.vocab_size, seed=4, count=2)  # 17 and 33 tokens
    params = greedy(MAX_NEW, return_routed_experts=True)
    outs, held = generate_counting_blocks(engine, prompts, params)
    assert_matches_hf(gpt_oss_dir, prompts, outs, max_new=MAX_NEW)
    assert_routing_matches_hf(gpt_oss_dir, prompts, outs, num_moe_layers=2, top_k=2)
    # unfreed, 81 + 97 tokens are 2 * (21 + 25) = 92 blocks of the 64: nobody was preempted
    assert engine.scheduler.num_preemptions == 0
    return engine, prompts, outs, held


def test_gpt_oss_sliding_group_holds_o_window_blocks(gpt_oss_ref) -> None:
    _, _, _, held = gpt_oss_ref
    assert_o_window(held, num_sliding_groups=1)


def test_gpt_oss_prefix_cache_warm_equals_cold(gpt_oss_dir, gpt_oss_ref) -> None:
    # a pool roomy enough that the sliding group's freed window blocks are not evicted (in
    # the 64-block engine decoding reuses them at once: a hit then needs them, so it is cut)
    _, prompts, cold, _ = gpt_oss_ref
    engine = mixed_engine(gpt_oss_dir, enable_return_routed_experts=True, num_kv_blocks=256)
    params = greedy(MAX_NEW, return_routed_experts=True)
    first = engine.generate(prompts, params, use_tqdm=False)
    warm = engine.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in warm] == [16, 32]
    assert_same(first, cold, atol=1e-5)
    assert_same(warm, cold, atol=1e-5)
    for w, c in zip(warm, cold):  # the cached prefix's routing is the computed one's
        np.testing.assert_array_equal(w.outputs[0].routed_experts, c.outputs[0].routed_experts)


# drafts wherever a 1-token match is found, whatever the measured cost
NGRAM_EVERY_STEP = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_min": 1,
    "adaptive": False,
}


@pytest.mark.parametrize(
    "variant",
    [
        {"async_scheduling": True},
        {"enforce_eager": False},  # the graph runner's eager replay of decode batches
        # verify rows replayed: sliding and full groups' tables, sinks, routed experts
        {"speculative_config": NGRAM_EVERY_STEP, "enforce_eager": False},
        {"num_kv_blocks": 40},  # preemption: the two sequences cannot run side by side
    ],
    ids=["async", "graph_replay", "ngram_spec_graphs", "preemption"],
)
def test_gpt_oss_variants_equal_the_serial_eager_run(gpt_oss_dir, gpt_oss_ref, variant):
    _, prompts, ref, _ = gpt_oss_ref
    engine = mixed_engine(gpt_oss_dir, **variant)
    outs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_same(outs, ref, atol=1e-5)
    if "enforce_eager" in variant:
        assert engine.stats.graph_replays > 0
        if "speculative_config" in variant:
            assert engine.stats.verify_graph_replays > 0
    if "num_kv_blocks" in variant:
        assert engine.scheduler.num_preemptions > 0
    engine.shutdown()


def test_gpt_oss_draft_model_frees_windows_and_equals_the_serial_run(gpt_oss_dir, gpt_oss_ref):
    # a draft near the target (its weights plus noise; it attends over the full group's
    # table, which keeps every block), under async scheduling: the sliding group still frees
    # what falls out of its window, tokens and logprobs are the serial run's, and the
    # validator admits a 97-token request that unfreed tables (25 + 25 blocks) would refuse
    _, prompts, ref, _ = gpt_oss_ref
    draft = near_draft(gpt_oss_dir)
    engine = spec_run(gpt_oss_dir, {"method": "draft_model", "model": draft}, num_kv_blocks=40)
    assert_spec_run_equals(engine, prompts, ref, num_sliding_groups=1)


@pytest.mark.parametrize(
    "method, graphs",
    [("ngram", False), ("ngram", True), ("suffix", False)],
    ids=["eager", "verify_graphs", "suffix"],
)
def test_gpt_oss_ngram_speculation_frees_windows_and_equals_no_speculation(
    tmp_path, method, graphs
) -> None:
    # n-gram (or suffix) drafts on a model whose greedy output repeats for a while: against
    # the same model without speculation, scheduled serially; with graphs, verify steps
    # replay over sliding tables whose blocks outside the window were freed
    model_dir = make_echo(make_gpt_oss(tmp_path / "echo"))
    ref_engine = mixed_engine(model_dir, async_scheduling=False)
    prompts = prompts_for(ref_engine.validator.vocab_size, seed=4, count=2)
    ref = ref_engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    ref_engine.shutdown()
    engine = spec_run(model_dir, {"method": method}, num_kv_blocks=40, enforce_eager=not graphs)
    assert_spec_run_equals(engine, prompts, ref, num_sliding_groups=1)
    assert (engine.stats.verify_graph_replays > 0) == graphs


def near_draft(model_dir: str) -> str:
    """The model's weights plus a little noise, with its tokenizer: a draft often right."""
    from transformers import AutoTokenizer

    draft, _ = perturbed_model(model_dir, model_dir + "_draft", seed=1, scale=0.01)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(draft)
    return draft


def spec_run(model_dir: str, spec: dict, **kw):
    """An engine speculating K tokens a step (always: the adaptive switch off), async
    scheduling, whose sliding groups free their blocks."""
    spec = {**spec, "num_speculative_tokens": K, "adaptive": False}
    engine = mixed_engine(model_dir, speculative_config=spec, **kw)
    assert engine.block_manager.frees_windows
    return engine


def assert_spec_run_equals(engine, prompts, ref, num_sliding_groups: int) -> None:
    """The speculating engine's greedy outputs equal `ref`, drafts were accepted and rejected,
    and its sliding tables stayed within the window and K drafts; then it shuts down."""
    outs, held = generate_counting_blocks(engine, prompts, greedy(MAX_NEW))
    assert_same(outs, ref, atol=1e-4)
    assert_spec_ran(engine)
    assert_o_window(held, num_sliding_groups, drafts=K)
    engine.shutdown()


def assert_spec_ran(engine) -> None:
    """Drafts were verified, some accepted and some rejected."""
    stats = engine.stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def kv_bytes_per_layer(model_dir: str) -> int:
    """K and V of one token in one layer, float32, from the HF config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return 2 * config.num_key_value_heads * config.head_dim * 4


def assert_same(got, ref, atol: float) -> None:
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert np.allclose(g.outputs[0].logprobs, r.outputs[0].logprobs, atol=atol)


@pytest.mark.parametrize(
    "types, groups, size",
    [
        # 5 sliding to 2 full: groups of 1 layer (the gcd), two of them full
        ([SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL], (None,) * 2 + (WINDOW,) * 5, 1),
        # 5 sliding to 3 full: groups of 3, one full and two sliding (the last of two layers)
        (
            [SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL, FULL],
            (None,) + (WINDOW,) * 2,
            3,
        ),
    ],
    ids=["two_full_groups", "uneven"],
)
def test_gemma3_groups_match_hf_in_o_window_blocks(tmp_path_factory, types, groups, size) -> None:
    model_dir = make_gemma3(
        tmp_path_factory.mktemp("mixed_gemma3"), num_hidden_layers=len(types), layer_types=types
    )
    engine = mixed_engine(model_dir, num_kv_blocks=256)  # roomy: the warm run hits
    assert engine.block_manager.windows == groups
    # a block holds one group's K/V: `size` of the layers
    assert engine.runner_info.kv_bytes_per_token == size * kv_bytes_per_layer(model_dir)
    prompts = prompts_for(engine.validator.vocab_size, seed=5, count=2)
    cold, held = generate_counting_blocks(engine, prompts, greedy(MAX_NEW))
    assert_matches_hf(model_dir, prompts, cold, max_new=MAX_NEW)
    num_sliding = groups.count(WINDOW)
    assert_o_window(held, num_sliding_groups=num_sliding)
    warm = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert [o.num_cached_tokens for o in warm] == [16, 32]
    assert_same(warm, cold, atol=1e-5)
    engine.shutdown()
    # speculation by a draft near the target (a Gemma 3 too, over the full group's table)
    engine = spec_run(
        model_dir, {"method": "draft_model", "model": near_draft(model_dir)}, num_kv_blocks=256
    )
    assert_spec_run_equals(engine, prompts, cold, num_sliding_groups=num_sliding)


def test_gpt_oss_late_grammar_mask_redoes_its_row_inside_the_window(gpt_oss_dir) -> None:
    # a row whose grammar mask was late computes its last position again, over both groups'
    # tables (the sliding group keeps one position of slack for it): the same tokens and
    # logprobs as the run without the stall
    from tests.unit.test_grammar_late_masks import run

    engine = mixed_engine(gpt_oss_dir, num_kv_blocks=256)  # room for max_tokens=200
    engine.executor.mask_board.wait_s = 0.0  # a row not ready at the end of its forward
    ref, _ = run(engine, slow=False, tag="0")
    got, _ = run(engine, slow=True, tag="1")
    assert engine.stats.grammar_skips >= 1
    for name in ("c", "f"):
        assert got[name]["ids"] == ref[name]["ids"], name
        np.testing.assert_allclose(got[name]["lps"], ref[name]["lps"], atol=1e-5)
    engine.shutdown()
