"""Speculative decoding's CPU parts: the configuration (vLLM's names, ValueErrors naming the
field), the n-gram and suffix proposers against brute-force references, the backoff, and the
counters on /metrics."""

from __future__ import annotations

import random

import pytest
from raylane.actors.engine import EngineConfig
from raylane.actors.engine.spec import SpeculativeConfig
from raylane.actors.engine.spec.backoff import Backoff
from raylane.actors.engine.spec.metrics import SpecStats
from raylane.actors.engine.spec.ngram import NgramProposer
from raylane.actors.engine.spec.suffix import SuffixIndex


def test_engine_config_takes_a_dict_with_vllm_names():
    config = EngineConfig(
        model="m",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
        },
    )
    assert config.spec == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    assert EngineConfig(model="m").spec is None
    suffix = EngineConfig(
        model="m", speculative_config={"method": "suffix", "num_speculative_tokens": 2}
    )
    assert suffix.spec.method == "suffix" and suffix.spec.prompt_lookup_min is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, "lookahead"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
        ("ngram", "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineConfig(model="m", speculative_config=value)
    assert field in str(e.value)


def brute_ngram(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The newest earlier occurrence of the longest tail n-gram (high .. low)."""
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_a_brute_force_search():
    rng = random.Random(0)
    proposer = NgramProposer(2, 4)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        assert proposer.propose(tokens, 3) == brute_ngram(tokens, 3, 2, 4), tokens
    assert NgramProposer(1, 3).propose([5, 6, 7, 8, 5, 6], 5) == [7, 8, 5, 6]
    assert NgramProposer(3, 3).propose([5, 6, 7, 8, 5, 6], 5) == []


def test_suffix_drafts_from_siblings():
    index = SuffixIndex(max_depth=4, min_probability=0.3)
    prompt = [1, 2, 3]
    first = prompt + [10, 11, 12, 13, 14, 15]
    second = prompt + [10, 11]  # a sibling, behind the first
    index.add(0, first, 3)
    index.add(1, second, 3)
    assert index.propose(1, 3) == [12, 13, 14]
    # a request with another prompt head is in another group: nothing to copy
    other = [9, 9, 9, 10, 11]
    index.add(2, other, 3)
    assert index.propose(2, 3) == []
    # the finished sibling stays a source while a member runs
    index.remove(0)
    second += [12]
    assert index.propose(1, 2) == [13, 14]


def test_suffix_takes_the_majority_continuation():
    index = SuffixIndex(max_depth=3, min_probability=0.5)
    head = [7, 7]
    for member, tail in enumerate(([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6])):
        index.add(member, head + tail, 2)
    index.add(9, head + [1], 2)
    # after 1: 2 three times of four; after 1 2: 3 twice of three (0.67); then the run ends
    assert index.propose(9, 4) == [2, 3]


def test_backoff_skips_after_failures_and_resets_on_acceptance():
    backoff = Backoff(max_skip=4)

    def ready_over(steps: int) -> list[bool]:
        out = []
        for _ in range(steps):
            backoff.tick()
            out.append(backoff.ready(1))
        return out

    assert backoff.ready(1)
    backoff.record(1, 3, 0)
    assert ready_over(2) == [False, True]  # the step after the failure is skipped
    backoff.record(1, 3, 0)
    assert not backoff.ready(1)
    assert ready_over(3) == [False, False, True]
    backoff.record(1, 3, 0)
    assert ready_over(5) == [False] * 4 + [True]
    backoff.record(1, 3, 0)  # capped at max_skip
    assert ready_over(5) == [False] * 4 + [True]
    backoff.record(1, 3, 1)  # an accepted token resets
    backoff.record(1, 3, 0)
    assert ready_over(2) == [False, True]


def test_spec_counters_reach_metrics():
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.engine.scheduler import Scheduler
    from raylane.actors.engine.stats import EngineStats
    from raylane.session_server.metrics import render

    stats = EngineStats()
    stats.spec = SpecStats(3)
    stats.spec.record(3, 2)
    stats.spec.record(2, 0)
    blocks = BlockManager(4, 16)
    snapshot = stats.snapshot(Scheduler(blocks, 4, 64), blocks)
    text = render("m", [snapshot, snapshot]).decode()
    assert 'raylane:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'raylane:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'raylane:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    per_pos = 'raylane:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
    assert per_pos % 0 + " 2.0" in text and per_pos % 1 + " 2.0" in text
    assert per_pos % 2 + " 0.0" in text


def test_speculative_config_from_yaml_and_the_serve_flag(tmp_path):
    from raylane.cli import build_parser
    from raylane.config import ClusterConfig
    from raylane.serve_cli import config_from_args

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "engine:\n  speculative_config:\n    method: suffix\n    num_speculative_tokens: 3\n"
    )
    argv = ["serve", "--config", str(path)]
    yaml_config = config_from_args(build_parser(argv).parse_args(argv))
    assert yaml_config.engine_config("/m").spec == SpeculativeConfig("suffix", 3)
    argv += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}']
    flags = config_from_args(build_parser(argv).parse_args(argv))  # the flag wins
    assert flags.engine_config("/m").spec.method == "ngram"
    assert flags.engine_config("/m").spec.num_speculative_tokens == 5
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        ClusterConfig.from_dict(
            {"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": -1}}}
        )
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            argv = ["serve", "--speculative-config", bad]
            build_parser(argv).parse_args(argv)


def test_suffix_keeps_a_bounded_number_of_finished_siblings():
    from raylane.actors.engine.spec import suffix

    index = SuffixIndex(max_depth=3)
    head = [4, 4]
    index.add(100, head + [1], 2)  # runs throughout
    for member in range(3 * suffix.MAX_FINISHED):
        index.add(member, head + [1, 50 + member], 2)
        index.propose(member, 1)
        index.remove(member)
    group = next(iter(index._groups.values()))
    assert len(group.tokens) == suffix.MAX_FINISHED + 1
    # the draft continues one of the kept members, never an evicted one
    draft = index.propose(100, 1)
    assert draft and draft[0] - 50 >= 2 * suffix.MAX_FINISHED


def test_cost_model_fits_step_times_and_prices_a_draft():
    from raylane.actors.engine.spec.cost_model import MIN_STEPS, WARMUP_STEPS, CostModel

    model = CostModel()
    assert model.threshold(1, 1) == 0.0  # no data: every draft is worth trying
    for i in range(WARMUP_STEPS + MIN_STEPS + 20):
        tokens = 1 + i % 40
        model.observe(tokens, 0.020 + 0.001 * tokens)
    a, b = model.fit()
    assert abs(a - 0.020) < 1e-9 and abs(b - 0.001) < 1e-9
    assert model.verify_s == 0.0  # no verify step seen
    assert abs(model.threshold(1, 1) - 0.001 / 0.021) < 1e-9  # batch 1: weights dominate
    assert abs(model.threshold(32, 32) - 0.032 / 0.052) < 1e-9


def test_adaptive_drafts_only_the_positions_that_pay():
    from raylane.actors.engine.block_manager import BlockManager
    from raylane.actors.engine.spec.acceptance import NUM_CLASSES
    from raylane.actors.engine.spec.drafter import Drafter

    config = SpeculativeConfig("ngram", 4, prompt_lookup_min=1)
    drafter = Drafter(config, BlockManager(8, 16), 256, None, SpecStats(4))
    for i in range(40):  # a compute-bound runner: a token costs as much as the fixed part
        tokens = 4 + i % 20
        drafter.cost.observe(tokens, 0.004 + 0.004 * tokens)
    # measured acceptance falls with the position: 90%, 60%, 30%, 10%
    drafter.acceptance.offered = [[100.0] * 4 for _ in range(NUM_CLASSES)]
    drafter.acceptance.hit = [[90.0, 60.0, 30.0, 10.0] for _ in range(NUM_CLASSES)]
    assert drafter._worth(1, 1) == 2  # threshold 0.004 / 0.008 = 0.5: positions 0 and 1
    assert drafter._worth(2, 2) == 1  # threshold 0.67: position 0
    assert drafter._worth(32, 32) == 0  # threshold 0.97: none, and no serial step for it
    assert not drafter.wants_serial([])
    off = Drafter(
        SpeculativeConfig("ngram", 4, adaptive=False), BlockManager(8, 16), 256, None, SpecStats(4)
    )
    off.cost = drafter.cost
    assert off._worth(32, 32) == 4
