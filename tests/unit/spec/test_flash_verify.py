"""Verify rows through the flash_attn backend (a fake of vLLM's fork that computes with the
torch reference, tests/unit/flash_fakes.py): replayed from the graph runner's [rows, 1 + k]
grid they give the tokens of eager verify steps, each step one fork call with
max_seqlen_q = 1 + k."""

from __future__ import annotations

from tests.unit.flash_fakes import fake_fork_module, install_for_cpu_engine
from tests.unit.spec.test_parity import NGRAM, K, greedy
from tests.unit.spec.test_verify_graphs import engine


def test_verify_rows_replay_through_flash_attn(monkeypatch, loopy_dir, prompts):
    fork = fake_fork_module((2,))
    install_for_cpu_engine(monkeypatch, fork)
    tokens, stats = {}, {}
    for graphs in (False, True):
        spec = engine(loopy_dir, NGRAM, graphs, attention_backend="FLASH_ATTN", dtype="bfloat16")
        try:
            outs = spec.generate(prompts, [greedy(max_tokens=24)] * len(prompts), use_tqdm=False)
            tokens[graphs] = [o.outputs[0].token_ids for o in outs]
            stats[graphs] = spec.stats
        finally:
            spec.shutdown()
    assert tokens[True] == tokens[False]
    assert stats[True].verify_graph_replays > 0 and stats[True].spec_decode_num_accepted_tokens
    assert any(call["max_seqlen_q"] == 1 + K for call in fork.calls)
