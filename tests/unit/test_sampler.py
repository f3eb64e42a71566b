"""The runner's Sampler on request states and random logits, against naive computations."""

from __future__ import annotations

import math

import pytest
import torch
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.runner.requests import RequestState
from raylane.actors.runner.sampler import Sampler, row_words

torch.set_num_threads(1)

VOCAB, PAD, EOS = 16, 3, 15


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(VOCAB, [EOS], torch.device("cpu"), seed)


def make_seq(
    prompt: list[int] | None = None,
    outputs: list[int] = (),
    index: int = 0,
    seq_id: int = 0,
    **params,
) -> RequestState:
    seq = RequestState(seq_id, index, prompt or [1, 2, 3], [], 0, SamplingParams(**params))
    seq.token_ids.extend(outputs)
    return seq


def random_logits(batch: int, seed: int) -> torch.Tensor:
    """[batch, VOCAB + PAD]; the padded columns are huge and must be ignored."""
    logits = torch.randn(batch, VOCAB + PAD, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, VOCAB:] = 100.0
    return logits


def argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda t: row[t])


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_total = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_total for x in row]


def naive_penalised(row, seq: RequestState) -> list[float]:
    p = seq.params
    prompt, outputs = seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
    result = []
    for tok, x in enumerate(row):
        count = outputs.count(tok)
        if tok in prompt or count:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        result.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return result


def vocab_rows(logits: torch.Tensor) -> list[list[float]]:
    return logits[:, :VOCAB].tolist()


# --- greedy and logprobs ----------------------------------------------------------------------


def test_greedy_rows_are_the_argmax_over_the_real_vocab():
    logits = random_logits(5, seed=1)
    seqs = [make_seq(temperature=0) for _ in range(5)]
    result = make_sampler()(logits.clone(), seqs)
    assert result.token_ids == [argmax(r) for r in vocab_rows(logits)]
    assert result.logprobs == [None] * 5 and result.top_logprobs == [None] * 5


def test_raw_logprobs_ignore_temperature_truncation_and_penalties():
    logits = random_logits(4, seed=2)
    seqs = [
        make_seq(temperature=0.5, top_k=3, logprobs=0, seed=1),
        make_seq(temperature=1.3, top_p=0.6, min_p=0.1, logprobs=2),
        make_seq(
            outputs=[4, 4, 5],
            repetition_penalty=1.8,
            presence_penalty=1.0,
            logprobs=1,
            temperature=0,
        ),
        make_seq(min_tokens=3, logprobs=3, temperature=0.7),
    ]
    result = make_sampler()(logits.clone(), seqs)
    for row, tok, lp in zip(vocab_rows(logits), result.token_ids, result.logprobs):
        assert lp == pytest.approx(log_softmax(row)[tok], abs=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_top_logprobs_are_the_n_best_raw_logprobs(n):
    logits = random_logits(3, seed=3)
    seqs = [make_seq(temperature=t, logprobs=n, top_k=2) for t in (0, 0.8, 2.0)]
    result = make_sampler()(logits.clone(), seqs)
    for row, top in zip(vocab_rows(logits), result.top_logprobs):
        lps = log_softmax(row)
        best = sorted(range(VOCAB), key=lambda t: -lps[t])[:n]
        assert list(top) == best
        assert list(top.values()) == pytest.approx([lps[t] for t in best], abs=1e-5)


def test_rows_get_their_own_number_of_top_logprobs():
    logits = random_logits(3, seed=4)
    seqs = [make_seq(logprobs=1), make_seq(logprobs=4), make_seq()]
    result = make_sampler()(logits.clone(), seqs)
    assert [len(t) if t is not None else None for t in result.top_logprobs] == [1, 4, None]
    assert result.logprobs[2] is None


def test_logprobs_zero_gives_the_same_output_alone_or_batched():
    logits = random_logits(2, seed=5)
    alone = make_sampler()(logits[:1].clone(), [make_seq(logprobs=0, temperature=0)])
    batched = make_sampler()(
        logits.clone(), [make_seq(logprobs=0, temperature=0), make_seq(logprobs=2, temperature=0)]
    )
    assert alone.top_logprobs[0] == batched.top_logprobs[0] == {}
    assert alone.logprobs[0] == pytest.approx(batched.logprobs[0])


# --- min_tokens and penalties -----------------------------------------------------------------


def eos_heavy_logits(batch: int) -> torch.Tensor:
    logits = random_logits(batch, seed=6)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0
    return logits


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = eos_heavy_logits(4)
    seqs = [
        make_seq(min_tokens=2, temperature=0),  # eos masked: 7 is next best
        make_seq(min_tokens=2, stop_token_ids=[7], temperature=0),  # eos and 7 masked
        make_seq(outputs=[1, 2], min_tokens=2, temperature=0),  # min_tokens reached
        make_seq(min_tokens=2, ignore_eos=True, temperature=0),  # eos is not a stop here
    ]
    result = make_sampler()(logits.clone(), seqs)
    masked = vocab_rows(logits)[1]
    masked[EOS] = masked[7] = -math.inf
    assert result.token_ids == [7, argmax(masked), EOS, EOS]


def test_min_tokens_masks_eos_for_sampled_rows_too():
    logits = eos_heavy_logits(64)
    seqs = [make_seq(min_tokens=1, temperature=5.0, seed=i) for i in range(64)]
    assert EOS not in make_sampler()(logits, seqs).token_ids


def test_penalties_change_the_choice_as_the_naive_computation_says():
    changed = 0
    for case in range(40):
        gen = torch.Generator().manual_seed(100 + case)
        prompt = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
        outputs = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
        params = {
            "repetition_penalty": [1.0, 1.3, 2.5][case % 3],
            "presence_penalty": [0.0, 1.5, -1.0][case % 3 - 1],
            "frequency_penalty": [0.7, 0.0, 1.9][case % 3 - 2],
            "temperature": 0,
        }
        seq = make_seq(prompt, outputs, **params)
        logits = random_logits(1, seed=200 + case) / 3
        (token,) = make_sampler()(logits.clone(), [seq]).token_ids
        row = vocab_rows(logits)[0]
        assert token == argmax(naive_penalised(row, seq))
        changed += token != argmax(row)
    assert changed >= 5  # the cases really exercise the penalties


# --- the random stream: a function of (seed, stream, output position) -------------------------


def run_steps(
    sampler: Sampler, seqs: list[RequestState], watch: RequestState, steps: int
) -> list[int]:
    """Sample `steps` times, appending to every sequence; return `watch`'s tokens."""
    for step in range(steps):
        logits = random_logits(len(seqs), seed=1000 + step)
        logits[seqs.index(watch)] = random_logits(1, seed=step)[0]  # watch sees the same rows
        tokens = sampler(logits, seqs).token_ids
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
    return watch.output_token_ids


def other_rows(variant: int) -> list[RequestState]:
    """Six neighbours, a different mix for each variant."""
    rows = [
        make_seq(temperature=1.0, seq_id=11),
        make_seq(seed=99, top_k=4, seq_id=12),
        make_seq(temperature=0, seq_id=13),
        make_seq(seed=5, min_p=0.2, index=3, seq_id=14),
        make_seq(temperature=0.5, logprobs=2, seq_id=15),
        make_seq(presence_penalty=1.0, top_p=0.7, seq_id=16),
    ]
    return rows[variant:] + [make_seq(seed=variant, seq_id=20 + i) for i in range(variant)]


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 42},
        {"seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 8},
        {"seed": 3, "min_p": 0.05, "repetition_penalty": 1.2, "index": 1},
    ],
)
def test_seeded_rows_are_batch_independent(params):
    params = dict(params)
    index = params.pop("index", 0)
    alone = make_seq(index=index, **params)
    alone_tokens = run_steps(make_sampler(seed=0), [alone], alone, steps=12)
    for position, variant in ((1, 0), (5, 2)):  # a batch of 7, the row at two positions
        twin = make_seq(index=index, seq_id=40 + position, **params)
        batch = other_rows(variant)
        batch.insert(position, twin)
        assert run_steps(make_sampler(seed=123 + variant), batch, twin, 12) == alone_tokens
    assert len(set(alone_tokens)) > 1


def tokens_of(steps: int = 12, engine_seed: int = 0, **params) -> list[int]:
    """A fresh row's tokens over `steps` steps, alone, on fixed logits rows."""
    seq = make_seq(**params)
    return run_steps(make_sampler(engine_seed), [seq], seq, steps)


@pytest.mark.parametrize(
    "a, b, same",
    [
        ({"seed": 5}, {"seed": 5}, True),  # two runs
        ({"seed": 5, "seq_id": 1}, {"seed": 5, "seq_id": 9, "engine_seed": 3}, True),
        ({"seed": 5, "index": 0}, {"seed": 5, "index": 1}, False),  # the n samples of one request
        ({"seed": 5}, {"seed": 6}, False),
        ({"seed": -1}, {"seed": 2**64 - 1}, False),
        ({"seq_id": 1}, {"seq_id": 1, "index": 3}, True),  # unseeded: the seq_id is the stream
        ({"seq_id": 1}, {"seq_id": 2}, False),
        ({"seq_id": 1}, {"seq_id": 1, "engine_seed": 1}, False),
        ({"seed": 0, "seq_id": 0}, {"seq_id": 0}, False),  # seed 0 is not the engine's seed 0
    ],
)
def test_what_the_tokens_depend_on(a, b, same):
    assert (tokens_of(**a) == tokens_of(**b)) is same


def test_a_rebuilt_state_draws_what_the_running_one_did():
    """The draw depends on the output position only, not on the calls made before: a state
    rebuilt from its tokens (as a recompute would see them) samples the same."""
    running = make_seq(seed=8, index=2, temperature=1.5)
    tokens = run_steps(make_sampler(), [running], running, steps=10)
    for k in range(10):
        rebuilt = make_seq(outputs=tokens[:k], seed=8, index=2, temperature=1.5, seq_id=77)
        assert make_sampler(seed=4)(random_logits(1, seed=k), [rebuilt]).token_ids == [tokens[k]]


def test_any_int_seed_gets_its_own_words():
    seeds = [
        -(2**100),
        -(2**64) + 5,
        -(2**63),
        -1,
        0,
        5,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64 + 5,
        2**100,
    ]
    seqs = [make_seq(seed=s) for s in seeds]
    assert len({row_words(seq, 0)[:2] for seq in seqs}) == len(seeds)
    assert len(make_sampler()(random_logits(len(seeds), seed=1), seqs).token_ids) == len(seeds)


def test_top_k_one_equals_greedy():
    logits = random_logits(8, seed=9)
    seqs = [
        make_seq(temperature=t, top_k=1, seed=s)
        for t, s in [(0.5, None), (1.0, 1), (2.0, None), (5.0, 2)] * 2
    ]
    result = make_sampler()(logits.clone(), seqs)
    assert result.token_ids == [argmax(r) for r in vocab_rows(logits)]


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    # as large as a client may send (the fuzzer found 2**63): the same draw as top_k off
    logits = random_logits(4, seed=11)
    huge = [make_seq(top_k=k, seed=5, index=i) for i, k in enumerate([2**63, 10**30, 7, 2**31])]
    off = [make_seq(top_k=k, seed=5, index=i) for i, k in enumerate([0, 0, 7, 0])]
    assert (
        make_sampler()(logits.clone(), huge).token_ids
        == make_sampler()(logits.clone(), off).token_ids
    )


ROWS_BY = {  # rows that differ only in what picks their random stream
    "seq_id": lambda i: make_seq(seq_id=i),
    "index": lambda i: make_seq(index=i, seed=3),
    "seed": lambda i: make_seq(seed=i),
    "position": lambda i: make_seq(outputs=[0] * i, seed=3),
}


@pytest.mark.parametrize("vary", list(ROWS_BY))
def test_sampled_rows_follow_the_temperature_distribution(vary):
    probs = (0.5, 0.3, 0.0, 0.15, 0.05)
    row = [math.log(p) if p else -math.inf for p in probs] + [-30.0] * (VOCAB - 5)
    n = 1500 if vary == "position" else 4000
    seqs = [ROWS_BY[vary](i) for i in range(n)]
    tokens = make_sampler(seed=1)(torch.tensor([row + [100.0] * PAD] * n), seqs).token_ids
    counts = [tokens.count(t) for t in range(5)]
    assert sum(counts) == n and counts[2] == 0
    # 3 degrees of freedom: P(chi2 > 25) is about 2e-5
    assert sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p) < 25
