"""Scheduler: token budget, chunked prefill, max_num_seqs, FCFS, preemption, n > 1, finish.

A `FakeEngine` plays the engine without a model: schedule, advance every item, append a token
where the item samples. It also keeps a fake KV cache (slot -> the token prefix whose K/V the
slot holds) so every step can check that a sequence's context really is in its blocks. With
`async_=True` it launches step N+1 before it folds in step N, as async scheduling does (the
fake runner computes a step when it is folded in, in launch order, as the real one would).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from raylane.actors.engine.sequence import Sequence, SequenceStatus
from raylane.actors.engine.state_slots import StateSlotPool


def next_token(seq: Sequence) -> int:
    """Deterministic per (request, sample, position), so a recompute yields the same tokens."""
    return (int(seq.request_id) * 7 + seq.index * 3 + len(seq) * 5) % 11


class FakeEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        budget: int = 64,
        caching: bool = True,
        async_: bool = False,
        state_slots: int | None = None,
    ):
        self.async_ = async_
        self.in_flight: list[ScheduledSeq] | None = None
        self.folded = 0  # items the last step folded in
        self.bm = BlockManager(num_blocks, block_size, caching)
        states = StateSlotPool(state_slots) if state_slots else None
        self.sched = Scheduler(self.bm, max_num_seqs, budget, states=states)
        self.block_size = block_size
        self.seqs: list[Sequence] = []
        self.kv: dict[int, tuple[int, ...]] = {}

    def add(self, prompt: list[int], max_tokens: int, n: int = 1) -> list[Sequence]:
        params = SamplingParams(max_tokens=max_tokens, n=n)
        rid = str(len({s.request_id for s in self.seqs}))
        seqs = [Sequence(rid, i, prompt, params, self.block_size) for i in range(n)]
        seqs[0].siblings = seqs[1:]
        self.sched.add(seqs[0])
        self.seqs += seqs
        return seqs

    def step(self) -> SchedulerOutput:
        if not self.async_:
            out = self.sched.schedule()
            self._fold_in(self._launch(out))
            return out
        if self.in_flight is None:
            self.in_flight = self._launch(self.sched.schedule())
        out = self.sched.schedule()  # planned while the step before is in flight
        due, self.in_flight = self.in_flight, self._launch(out)
        self._fold_in(due)
        return out

    def _launch(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        for item in out.scheduled:
            self.sched.launched(item)
        return out.scheduled

    def _fold_in(self, scheduled: list[ScheduledSeq]) -> None:
        self.folded = len(scheduled)
        for item in scheduled:
            seq = item.seq
            if seq.is_finished:
                continue  # its work in the step is dropped
            if seq.num_preemptions == item.preemptions:  # else it is recomputed later
                self._compute(seq, item.start, item.num_new)
            self.sched.confirm(item)
            if item.samples:
                seq.append_token(next_token(seq), None, None)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq)

    def busy(self) -> bool:
        return self.sched.has_unfinished() or bool(self.in_flight)

    def run(self, max_steps: int = 500) -> int:
        for steps in range(max_steps):
            if not self.busy():
                return steps
            assert_progress(self.step())
        raise AssertionError(f"not finished after {max_steps} steps")

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _compute(self, seq: Sequence, start: int, num_new: int) -> None:
        """Check the cached context is this sequence's own prefix, then write the new K/V."""
        for pos in range(start):
            assert self.kv.get(self._slot(seq, pos)) == tuple(seq.token_ids[: pos + 1]), (
                f"seq {seq.seq_id}: KV at position {pos} is not its own"
            )
        for pos in range(start, start + num_new):
            block = self.bm.blocks[seq.block_table[pos // self.block_size]]
            assert block.ref_count == 1, "writing into a block another sequence shares"
            self.kv[self._slot(seq, pos)] = tuple(seq.token_ids[: pos + 1])


def assert_progress(out: SchedulerOutput) -> None:
    # a step may only preempt (a sequence that cannot grow preempts itself), but never do nothing
    assert not out.is_empty or out.preempted, "schedule() returned nothing with work left"


def prompt_of(n: int, base: int = 0) -> list[int]:
    return [(base + i) % 11 for i in range(n)]


# --- budget and chunked prefill ---------------------------------------------------------------


def test_long_prompt_is_chunked_by_the_token_budget():
    eng = FakeEngine(num_blocks=16, budget=8)
    (seq,) = eng.add(prompt_of(20), max_tokens=3)
    chunks = []
    for _ in range(3):
        out = eng.sched.schedule()
        assert [i.seq for i in out.prefills] == [seq] and not out.decodes
        chunks.append((out.prefills[0].num_new, out.prefills[0].samples))
        for item in out.scheduled:
            eng.sched.launched(item)
            eng.sched.confirm(item)
    assert chunks == [(8, False), (8, False), (4, True)]
    seq.append_token(1, None, None)
    out = eng.sched.schedule()
    assert [(i.seq, i.num_new) for i in out.decodes] == [(seq, 1)] and not out.prefills


def test_decodes_run_alongside_a_chunked_prefill():
    eng = FakeEngine(num_blocks=32, budget=8)
    (short,) = eng.add(prompt_of(3), max_tokens=10)
    eng.step()
    (long,) = eng.add(prompt_of(30, base=5), max_tokens=2)
    for expected_chunk in (7, 7, 7, 7, 2):
        out = eng.step()
        assert [(i.seq, i.num_new) for i in out.decodes] == [(short, 1)]
        assert [(i.seq, i.num_new) for i in out.prefills] == [(long, expected_chunk)]
        assert out.num_tokens <= 8
    assert long.num_output_tokens == 1


def test_budget_is_never_exceeded_by_many_decodes():
    eng = FakeEngine(num_blocks=64, budget=3, max_num_seqs=8)
    for i in range(5):
        eng.add(prompt_of(2, base=i), max_tokens=4)
    while eng.sched.has_unfinished():
        assert eng.step().num_tokens <= 3
    assert all(s.num_output_tokens == 4 for s in eng.seqs)


def test_max_num_seqs_limits_running():
    eng = FakeEngine(num_blocks=64, max_num_seqs=2)
    a, b, c = (eng.add(prompt_of(3, base=i), max_tokens=2 + i)[0] for i in range(3))
    out = eng.step()
    assert {i.seq for i in out.scheduled} == {a, b}
    assert list(eng.sched.waiting) == [c]
    eng.step()  # a finishes after its second token
    assert a.is_finished and list(eng.sched.waiting) == [c]
    out = eng.step()
    assert c in {i.seq for i in out.scheduled}


def test_state_slots_bound_running_and_pass_from_finished_to_waiting():
    # a linear-attention model: 2 state slots under max_num_seqs=8; the third request waits
    eng = FakeEngine(num_blocks=64, max_num_seqs=8, state_slots=2)
    a, b, c = (eng.add(prompt_of(3, base=i), max_tokens=2 + i)[0] for i in range(3))
    out = eng.step()
    assert {i.seq for i in out.scheduled} == {a, b} and list(eng.sched.waiting) == [c]
    assert {a.state_slot, b.state_slot} == {0, 1}
    slot_a = a.state_slot
    eng.step()  # a finishes after its second token: its slot goes to c
    assert a.is_finished and a.state_slot is None
    out = eng.step()
    assert c in {i.seq for i in out.scheduled} and c.state_slot == slot_a
    eng.run()
    assert eng.sched.states is not None and eng.sched.states.num_free == 2


def test_preemption_returns_the_state_slot():
    eng = FakeEngine(num_blocks=4, block_size=2, caching=False, state_slots=2)
    (a,) = eng.add(prompt_of(3), max_tokens=4)
    (b,) = eng.add(prompt_of(3, base=4), max_tokens=4)
    eng.step()
    eng.step()
    out = eng.step()  # a needs a third block: b is preempted, its slot freed
    assert out.preempted == [b] and b.state_slot is None
    assert eng.sched.states is not None and eng.sched.states.num_free == 1
    eng.run()
    assert b.num_output_tokens == 4 and eng.sched.states.num_free == 2


# --- FCFS -------------------------------------------------------------------------------------


def test_queue_head_is_never_overtaken():
    eng = FakeEngine(num_blocks=6, budget=64, caching=False)
    (a,) = eng.add(prompt_of(12), max_tokens=4)  # 3 blocks, leaves 3
    eng.step()
    (big,) = eng.add(prompt_of(16, base=3), max_tokens=2)  # needs 4 blocks: must wait
    (small,) = eng.add(prompt_of(2, base=7), max_tokens=2)  # would fit, but queues behind
    while not a.is_finished:
        out = eng.step()
        assert {i.seq for i in out.scheduled} == {a}
        assert list(eng.sched.waiting) == [big, small]
    out = eng.step()
    assert out.prefills[0].seq is big
    eng.run()


def test_waiting_requests_start_in_arrival_order():
    eng = FakeEngine(num_blocks=64, max_num_seqs=1)
    seqs = [eng.add(prompt_of(3, base=i), max_tokens=1)[0] for i in range(4)]
    order = []
    while eng.sched.has_unfinished():
        order += [i.seq for i in eng.step().prefills]
    assert order == seqs


# --- preemption -------------------------------------------------------------------------------


def test_newest_running_sequence_is_preempted_and_recomputed():
    eng = FakeEngine(num_blocks=4, block_size=2, caching=False)
    (a,) = eng.add(prompt_of(3), max_tokens=4)
    (b,) = eng.add(prompt_of(3, base=4), max_tokens=4)
    eng.step()
    eng.step()  # both hold 2 blocks; the cache is full
    (late,) = eng.add(prompt_of(1, base=9), max_tokens=1)
    b_tokens = list(b.token_ids)
    out = eng.step()  # a needs a third block: b (newest) goes
    assert out.preempted == [b]
    assert [i.seq for i in out.scheduled] == [a]
    assert list(eng.sched.waiting) == [b, late]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.token_ids == b_tokens  # generated tokens are kept
    assert eng.bm.num_free_blocks == 4 - len(a.block_table)
    while not a.is_finished:
        assert b not in {i.seq for i in eng.step().scheduled}
    out = eng.step()
    assert (out.prefills[0].seq, out.prefills[0].num_new) == (b, len(b_tokens))
    eng.run()
    assert b.num_output_tokens == 4


def test_preemption_takes_the_newest_of_several():
    eng = FakeEngine(num_blocks=6, block_size=2, caching=False)
    seqs = [eng.add(prompt_of(3, base=3 * i), max_tokens=3)[0] for i in range(3)]
    eng.step()
    eng.step()
    out = eng.step()  # every sequence wants a third block; only the newest goes
    assert out.preempted == [seqs[2]]
    assert {i.seq for i in out.scheduled} == {seqs[0], seqs[1]}
    eng.run()
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_preempted_sequence_recomputes_from_its_own_cached_blocks():
    eng = FakeEngine(num_blocks=4, block_size=2, caching=True)
    eng.add(prompt_of(3), max_tokens=4)
    (b,) = eng.add(prompt_of(3, base=4), max_tokens=4)
    eng.step()
    eng.step()
    assert eng.step().preempted == [b]
    eng.run()  # the fake KV check asserts every reused block holds b's own prefix
    assert b.num_output_tokens == 4 and b.num_cached_tokens == 0


def test_waiting_head_holding_cached_blocks_does_not_deadlock():
    """A waiting request that took cached prefix blocks must not starve a preempted one.

    p fills the cache with a prefix; c runs; b looks up p's prefix (holding those blocks) but
    cannot get a block for its last token; c then runs out and preempts itself. With b holding
    its blocks in the queue, c can never be rescheduled unless someone gives blocks back.
    """
    eng = FakeEngine(num_blocks=4, block_size=2, caching=True)
    eng.add([9, 9, 9, 9, 9], max_tokens=1)
    eng.run()
    (c,) = eng.add([5, 5, 5], max_tokens=4)
    (b,) = eng.add([9, 9, 9, 9, 7], max_tokens=1)
    eng.run(max_steps=50)
    assert c.num_output_tokens == 4 and b.num_output_tokens == 1
    assert eng.bm.num_free_blocks == 4


# --- n > 1 ------------------------------------------------------------------------------------


def test_siblings_wait_until_the_prompt_is_computed_then_share_it():
    eng = FakeEngine(num_blocks=32, block_size=4, budget=4)
    head, *siblings = eng.add(prompt_of(12), max_tokens=4, n=3)
    (other,) = eng.add(prompt_of(2, base=5), max_tokens=1)
    for _ in range(2):  # the prompt takes three full chunks of 4
        eng.step()
        assert list(eng.sched.waiting) == [other]
    eng.step()
    assert head.prompt_done
    assert list(eng.sched.waiting) == [*siblings, other]  # released ahead of later requests
    out = eng.step()
    assert [i.seq for i in out.prefills] == [siblings[0]]
    # 8 of the 12 prompt tokens come from head's blocks (the last block is recomputed)
    assert siblings[0].num_cached_tokens == 8
    assert siblings[0].block_table[:2] == head.block_table[:2]
    assert all(eng.bm.blocks[b].ref_count == 2 for b in head.block_table[:2])
    eng.run()
    assert all(s.num_output_tokens == 4 for s in (head, *siblings))
    assert len({tuple(s.output_token_ids) for s in (head, *siblings)}) == 3


# --- finish -----------------------------------------------------------------------------------


def test_finish_frees_blocks_from_running_and_waiting():
    eng = FakeEngine(num_blocks=16, max_num_seqs=1)
    (a,) = eng.add(prompt_of(6), max_tokens=8)
    (b,) = eng.add(prompt_of(6, base=2), max_tokens=8)
    eng.step()
    eng.sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert eng.bm.num_free_blocks == 16 and eng.sched.running == []
    eng.sched.finish(b)
    assert not eng.sched.has_unfinished()


def test_finishing_the_head_before_its_prompt_ends_finishes_its_siblings():
    eng = FakeEngine(num_blocks=16, budget=2)
    head, *siblings = eng.add(prompt_of(6), max_tokens=2, n=3)
    eng.step()
    eng.sched.finish(head)
    assert all(s.is_finished for s in siblings)
    assert not eng.sched.has_unfinished() and eng.bm.num_free_blocks == 16


# --- randomized workloads ---------------------------------------------------------------------


def check_invariants(eng: FakeEngine, out: SchedulerOutput) -> None:
    bm, sched = eng.bm, eng.sched
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    owners: dict[int, list[Sequence]] = {}
    for seq in eng.seqs:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            owners.setdefault(block_id, []).append(seq)
    running = set(sched.running)
    for block_id, holders in owners.items():
        block = bm.blocks[block_id]
        assert block.ref_count == len(holders)
        assert block_id not in bm.free
        if len([s for s in holders if s in running]) > 1:
            assert block.hash is not None, "two running sequences share an uncached block"
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert used == len(owners) and bm.num_free_blocks + used == bm.num_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING


request_st = st.tuples(
    st.integers(0, 2),  # which shared prefix pool
    st.integers(1, 10),  # prompt length
    st.integers(1, 8),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 6),  # arrival step
)


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(6, 14),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(1, 4),
    caching=st.booleans(),
    requests=st.lists(request_st, min_size=1, max_size=6),
    async_=st.booleans(),
)
def test_random_workloads_finish_with_invariants(
    block_size, num_blocks, budget, max_num_seqs, caching, requests, async_
):
    eng = FakeEngine(num_blocks, block_size, max_num_seqs, budget, caching, async_)
    pools = [[p] * 2 + prompt_of(10, base=p) for p in range(3)]
    pending = sorted(requests, key=lambda r: r[4])
    for step in range(400):
        while pending and pending[0][4] <= step:
            pool, plen, max_tokens, n, _ = pending.pop(0)
            # like the validator: each sequence must fit in the cache on its own
            max_tokens = min(max_tokens, num_blocks * block_size - plen)
            eng.add(pools[pool][:plen], max_tokens, n)
        if not pending and not eng.busy():
            break
        out = eng.step()
        if not pending and not eng.folded:  # async: folding in a step is progress too
            assert_progress(out)
        check_invariants(eng, out)
    else:
        raise AssertionError("workload did not finish")
    for seq in eng.seqs:
        assert seq.is_finished and seq.num_output_tokens == seq.params.max_tokens
    assert eng.bm.num_free_blocks == num_blocks
