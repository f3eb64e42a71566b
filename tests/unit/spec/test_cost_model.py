"""When drafting pays (spec/cost_model.py and the Drafter's decision): fed step times and
acceptance rates whose outcome is worked out by hand here; and an engine on text nothing can
predict stops drafting once it has measured that."""

from __future__ import annotations

from raylane.actors.engine import SamplingParams
from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.spec.acceptance import IDLE_DECAY, NUM_CLASSES
from raylane.actors.engine.spec.config import SpeculativeConfig
from raylane.actors.engine.spec.cost_model import MIN_STEPS, WARMUP_STEPS, CostModel
from raylane.actors.engine.spec.drafter import Drafter
from raylane.actors.engine.spec.metrics import SpecStats

from tests.unit.spec.helpers import spec_engine

# a runner whose step takes 20 ms + 1 ms per token, and 15 ms more when it verifies drafts
A, B, C = 0.020, 0.001, 0.015


def fitted(model: CostModel) -> CostModel:
    for i in range(WARMUP_STEPS + MIN_STEPS + 40):
        rows = 1 + i % 32
        drafts = (i % 3) * (1 + i % 4)  # a third of the steps plain, the others verify
        tokens = rows + drafts
        model.observe(tokens, A + B * tokens + C * (drafts > 0), verifies=drafts > 0)
    return model


def test_the_fit_separates_a_verify_steps_fixed_cost():
    model = fitted(CostModel())
    a, b = model.fit()
    assert abs(a - A) < 1e-9 and abs(b - B) < 1e-9 and abs(model.verify_s - C) < 1e-9

    for _ in range(200):  # plain steps only: the verify estimate lapses (re-measured later)
        model.observe(8, A + B * 8)
    assert model.verify_s == 0.0 and model.fit() is not None


def test_no_acceptance_at_batch_32_is_off_and_high_acceptance_at_batch_1_is_on():
    model = fitted(CostModel())
    # batch 32: a token is worth (20 + 32) / 32 ms; 128 draft tokens cost 128 ms + 15 ms
    assert not model.pays(32, 32, expected=0.0, num_drafts=128, serial=1)
    assert not model.pays(32, 32, expected=80.0, num_drafts=128, serial=1)  # 130 < 143 ms
    assert model.pays(32, 32, expected=100.0, num_drafts=128, serial=1)  # 162.5 > 143 ms
    # batch 1: a token is worth 21 ms; 4 drafts cost 4 + 15 ms
    assert model.pays(1, 1, expected=3.0, num_drafts=4, serial=1)
    assert not model.pays(1, 1, expected=0.8, num_drafts=4, serial=1)  # 16.8 < 19 ms


def test_the_lost_overlap_is_measured_and_priced():
    model = fitted(CostModel())
    assert model.overlap_s == 0.0  # nothing measured yet: free
    for _ in range(50):
        model.observe_gap(ahead=True, seconds=0.001)
        model.observe_gap(ahead=False, seconds=0.011)
    assert abs(model.overlap_s - 0.010) < 1e-9
    # batch 1, one draft accepted for sure: 21 ms against 1 + 15 ms, + 10 ms per serial step
    assert model.pays(1, 1, expected=1.0, num_drafts=1, serial=0)
    assert not model.pays(1, 1, expected=1.0, num_drafts=1, serial=1)


def drafter_with(acceptance: list[float]) -> Drafter:
    config = SpeculativeConfig("ngram", 4, prompt_lookup_min=1)
    drafter = Drafter(config, BlockManager(64, 16), 256, None, SpecStats(4))
    fitted(drafter.cost)
    drafter.acceptance.offered = [[1000.0] * 4 for _ in range(NUM_CLASSES)]
    drafter.acceptance.hit = [[1000.0 * p for p in acceptance] for _ in range(NUM_CLASSES)]
    return drafter


def running(num: int) -> list[Sequence]:
    return [Sequence("r", i, [1, 2, 3], SamplingParams(max_tokens=64), 16) for i in range(num)]


def test_the_drafter_plans_serially_only_where_drafts_pay():
    assert not drafter_with([0.0] * 4).wants_serial(running(1))  # no position pays at all
    drafter = drafter_with([0.7, 0.3, 0.1, 0.0])
    # batch 1: positions 0-2 pay for their compute (> 1 / 21); 1.1 tokens x 21 ms = 23 ms
    # against 3 + 15 ms
    assert drafter._worth(1, 1) == 3
    assert drafter.wants_serial(running(1))
    # batch 32: a token is worth 1.625 ms, so position 0 pays for its own compute (0.7 > 1 /
    # 1.625), but 32 rows x 0.7 x 1.625 ms = 36 ms does not pay 32 + 15 ms
    assert drafter._worth(32, 32) == 1
    assert not drafter.wants_serial(running(32))


def test_random_text_stops_drafting_after_warm_up(tiny_llama_dir):
    """A tiny random model sampled at temperature 1: suffix lookups find matches (a small
    vocabulary repeats tokens) that are rarely right. After a warm-up run the engine has
    measured that; the next run drafts in (almost) no step."""
    engine = spec_engine(
        tiny_llama_dir, {"method": "suffix", "num_speculative_tokens": 4}, async_scheduling=True
    )
    steady_clock(engine.speculation.cost)
    vocab = engine.validator.vocab_size
    prompts = [[(7 * i + 13 * j) % vocab for j in range(24)] for i in range(16)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48) for i in range(16)]
    engine.generate(prompts, params, use_tqdm=False)
    spec, stats = engine.stats.spec, engine.stats
    assert spec.num_verify_steps > 0  # the warm-up drafted (and measured what it cost)
    verify_steps, steps = spec.num_verify_steps, stats.step_times.steps
    ahead = stats.steps_planned_ahead
    engine.generate(prompts, params, use_tqdm=False)
    steps = stats.step_times.steps - steps
    # the bounds say "mostly stopped": a stopped class is re-probed now and then
    assert spec.num_verify_steps - verify_steps <= steps // 4
    assert stats.steps_planned_ahead - ahead >= steps * 3 // 4  # the async overlap kept
    engine.shutdown()


def steady_clock(cost: CostModel) -> None:
    """The engine's cost model sees the runner above (A + B per token, + C to verify; 10 ms
    more for a step planned serially) instead of wall-clock times, which a loaded machine
    (CI's two pytest processes on 2 cores) makes noisy: tests never fail on timing."""
    observe, observe_gap = cost.observe, cost.observe_gap

    def steady(num_tokens: int, seconds: float, verifies: bool = False) -> None:
        observe(num_tokens, A + B * num_tokens + C * verifies, verifies)

    def steady_gap(ahead: bool, seconds: float) -> None:
        observe_gap(ahead, 0.001 if ahead else 0.011)

    cost.observe, cost.observe_gap = steady, steady_gap  # type: ignore[method-assign]


def test_acceptance_is_measured_per_match_class_and_trims_each_proposal():
    """A 1-token match is mostly wrong, a 4-token one mostly right (as measured on the bench's
    RL groups): the class of each proposal sets how many of its drafts pay, and its verify
    results count only for its class."""
    drafter = drafter_with([0.0] * 4)
    drafter.acceptance.hit[0] = [100.0, 40.0, 10.0, 0.0]  # 1-token matches: 10%, 4%, 1%, 0%
    drafter.acceptance.hit[3] = [900.0, 700.0, 400.0, 100.0]  # 4+: 90%, 70%, 40%, 10%
    # batch 4: threshold 4 ms / 24 ms = 0.17: no 1-token-match draft pays, three 4+ ones do
    assert abs(drafter.cost.threshold(4, 4) - 4 / 24) < 1e-9
    assert drafter._depths(4, 4) == [0, 0, 0, 3]
    assert drafter._worth(4, 4) == 3
    rows = running(4)
    drafter._last_class = {seq.seq_id: 0 for seq in rows}
    assert not drafter.wants_serial(rows)  # their last proposals were all 1-token matches

    class Item:  # what `accepted` reads of a ScheduledSeq
        def __init__(self, seq: Sequence, drafts: tuple[int, ...]):
            self.seq, self.drafts, self.start = seq, drafts, 3
            self.preemptions = seq.num_preemptions

    before = [list(row) for row in drafter.acceptance.offered]
    drafter._drafted_class[rows[0].seq_id] = 1
    drafter.accepted(Item(rows[0], (5, 6)), 2)
    for cls in range(NUM_CLASSES):
        if cls != 1:
            assert drafter.acceptance.offered[cls] == before[cls]
    assert drafter.acceptance.offered[1] == [0.99 * before[1][0] + 1, 0.99 * before[1][1] + 1] + [
        0.99 * x for x in before[1][2:]
    ]


def test_a_match_class_never_seen_takes_the_pooled_rate():
    """Random text: 1-token matches are measured (2 accepted of 100), longer ones never occur.
    An optimistic prior for those would keep every row's lookups going on every step."""
    config = SpeculativeConfig("suffix", 4)
    drafter = Drafter(config, BlockManager(64, 16), 256, None, SpecStats(4))
    fitted(drafter.cost)
    drafter.acceptance.offered[0] = [100.0] * 4
    drafter.acceptance.hit[0] = [2.0, 0.0, 0.0, 0.0]
    pooled = 3 / 101
    assert abs(drafter.acceptance.rate(0, 0) - (2 + pooled) / 101) < 1e-12
    assert drafter.acceptance.rate(3, 0) == pooled  # nothing measured: the pooled rate itself
    assert drafter._worth(4, 4) == 0  # threshold 0.17: no class pays, so no lookups
    assert not drafter.wants_serial(running(4))


def test_a_measurement_nothing_refreshes_fades_and_drafting_is_tried_again():
    """After 100 rejected drafts no position pays at batch 4; decode steps that draft nothing
    fade that evidence (IDLE_DECAY each), and once the pooled rate p = 1 / (100 * IDLE_DECAY^n
    + 1), which the classes never seen take, exceeds the threshold 1/6, position 0 pays
    again: the workload may have changed."""
    drafter = drafter_with([0.0] * 4)
    drafter.acceptance.offered = [[100.0] * 4] + [[0.0] * 4 for _ in range(NUM_CLASSES - 1)]
    drafter.acceptance.hit = [[0.0] * 4 for _ in range(NUM_CLASSES)]
    assert drafter._worth(4, 4) == 0
    steps = 0
    while drafter._worth(4, 4) == 0:
        drafter.acceptance.fade()
        steps += 1
    # by hand: c = 100 * IDLE_DECAY^n; 1 / (c + 1) > 1/6 first when c < 5
    expected = next(n for n in range(100_000) if 100 * IDLE_DECAY**n < 5)
    assert steps == expected


def test_lookups_back_off_while_the_proposals_do_not_pay(monkeypatch):
    """Proposals that never pay (a 1-token match at 1 % acceptance). While the lookups are
    cheap (under 1 % of the 24 ms step the fit predicts for a batch of 4) every step looks
    up. Once they cost more (0.2 ms a row here), the batch's lookups run on 1, 3, 6, 11, 20,
    37, 54 steps after (skipping 1, 2, 4, 8, 16, 16 steps); a step that pays resets it. The
    drafter's clock is a fake that only the lookups advance."""
    import types

    import raylane.actors.engine.spec.drafter as drafter_module
    from raylane.actors.engine.scheduler import ScheduledSeq, SchedulerOutput

    drafter = drafter_with([0.0] * 4)
    drafter.acceptance.hit[0] = [10.0, 0.0, 0.0, 0.0]  # 1 %: below every threshold at batch 4
    drafter.acceptance.hit[3] = [900.0] * 4  # 4-token matches pay: the lookups themselves may
    seqs = running(4)
    for seq in seqs:
        seq.num_computed_tokens = len(seq) - 1  # a decode row each
    looked: list[int] = []
    answer = {"match": 1, "seconds": 0.0}
    clock = {"now": 0.0}
    monkeypatch.setattr(
        drafter_module, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"])
    )

    def lookup(seq, k):
        looked.append(drafter.lookups.step)
        clock["now"] += answer["seconds"]
        return [7] * k, answer["match"]

    def run(steps: int) -> list[int]:
        looked.clear()
        for _ in range(steps):
            batch = SchedulerOutput(decodes=[ScheduledSeq(seq, 1) for seq in seqs])
            drafter.draft(batch)
            for item in batch.prefills:  # undo a draft, so every step starts alike
                item.drafts = ()
        return sorted(set(looked))

    drafter._lookup = lookup
    assert run(10) == list(range(1, 11))  # cheap: every step
    answer["seconds"] = 0.0002  # 0.8 ms a step: 3 % of it
    assert run(60) == [s + 10 for s in (1, 3, 6, 11, 20, 37, 54)]
    answer["match"] = 4  # now they pay
    # the skip in force runs out (64 + 16 + 1), then every step looks up
    assert run(20) == list(range(81, 91))
