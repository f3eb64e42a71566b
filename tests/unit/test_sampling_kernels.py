"""kernels.sampling against direct, naive Python computations on small known distributions."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import sampling

torch.set_num_threads(1)

NEG_INF = float("-inf")


def softmax(row: list[float]) -> list[float]:
    finite = [x for x in row if x != NEG_INF]
    top = max(finite)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def rows(t: torch.Tensor) -> list[list[float]]:
    return t.tolist()


# --- penalties --------------------------------------------------------------------------------


def naive_penalties(row, prompt, outputs, rep, presence, frequency):
    result = []
    for tok, logit in enumerate(row):
        count = outputs.count(tok)
        if tok in prompt or count:
            logit = logit / rep if logit > 0 else logit * rep
        logit -= frequency * count + presence * (1 if count else 0)
        result.append(logit)
    return result


def test_apply_penalties_matches_naive():
    logits = [[2.0, -1.0, 0.5, -3.0, 1.5, 0.0], [1.0, 1.0, -2.0, 4.0, -0.5, 3.0]]
    prompts = [[0, 1], [5]]
    outputs = [[2, 2, 3], [0, 5, 5, 5]]
    reps, presences, freqs = [1.5, 2.0], [0.5, -0.25], [0.1, 0.75]
    prompt_mask = torch.zeros(2, 6, dtype=torch.bool)
    counts = torch.zeros(2, 6)
    for i in range(2):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    got = sampling.apply_penalties(torch.tensor(logits), prompt_mask, counts,
                                   torch.tensor(reps), torch.tensor(presences), torch.tensor(freqs))
    for i in range(2):
        want = naive_penalties(logits[i], prompts[i], outputs[i], reps[i], presences[i], freqs[i])
        assert rows(got)[i] == pytest.approx(want, abs=1e-6)


def test_neutral_penalties_leave_logits_unchanged():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.bool)
    counts = torch.full((3, 10), 2.0)
    got = sampling.apply_penalties(logits, mask, counts, torch.ones(3), torch.zeros(3),
                                   torch.zeros(3))
    torch.testing.assert_close(got, logits)


# --- top-k / top-p ----------------------------------------------------------------------------


def naive_keep(row: list[float], top_k: int | None, top_p: float | None) -> set[int]:
    """Sort by hand, keep the top k, renormalise, keep while the mass above is below top_p."""
    order = sorted(range(len(row)), key=lambda t: -row[t])
    kept = order[:top_k] if top_k is not None else order
    if top_p is None:
        return set(kept)
    probs = softmax([row[t] for t in kept])
    result, above = set(), 0.0
    for tok, p in zip(kept, probs):
        if above < top_p or not result:
            result.add(tok)
        above += p
    return result


def kept_ids(masked: torch.Tensor) -> list[set[int]]:
    return [{t for t, x in enumerate(r) if x != NEG_INF} for r in rows(masked)]


DIST = [
    [0.5, 0.2, 0.15, 0.1, 0.05],  # cumulative 0.5, 0.7, 0.85, 0.95, 1.0
    [0.05, 0.1, 0.6, 0.2, 0.05001],
    [0.9, 0.04, 0.03, 0.02, 0.01],  # no ties: which tied token survives is arbitrary
]
LOGITS = [[math.log(p) for p in row] for row in DIST]


@pytest.mark.parametrize("top_k", [None, [1, 2, 5], [3, 5, 2]])
@pytest.mark.parametrize("top_p", [None, [0.5, 0.5, 0.5], [0.69, 0.78, 0.955], [1.0, 0.1, 0.995]])
def test_top_k_top_p_matches_naive(top_k, top_p):
    got = sampling.apply_top_k_top_p(
        torch.tensor(LOGITS), torch.tensor(top_k) if top_k else None,
        torch.tensor(top_p) if top_p else None)
    for i, row in enumerate(LOGITS):
        want = naive_keep(row, top_k[i] if top_k else None, top_p[i] if top_p else None)
        assert kept_ids(got)[i] == want


def test_top_p_boundaries_by_hand():
    logits = torch.tensor([LOGITS[0]] * 4)
    top_p = torch.tensor([0.5, 0.50001, 0.7, 0.96])
    # mass strictly above each token: 0, .5, .7, .85, .95
    assert kept_ids(sampling.apply_top_k_top_p(logits, None, top_p)) == [
        {0}, {0, 1}, {0, 1}, {0, 1, 2, 3, 4}]


def test_top_p_tiny_keeps_the_argmax():
    got = sampling.apply_top_k_top_p(torch.tensor(LOGITS), None, torch.full((3,), 1e-6))
    assert kept_ids(got) == [{0}, {2}, {0}]


def test_top_k_top_p_keeps_surviving_logits_unchanged():
    logits = torch.tensor(LOGITS)
    got = sampling.apply_top_k_top_p(logits, torch.tensor([2, 3, 4]), None)
    keep = got != NEG_INF
    torch.testing.assert_close(got[keep], logits[keep])


def test_top_k_top_p_off_is_identity():
    logits = torch.tensor(LOGITS)
    got = sampling.apply_top_k_top_p(logits, torch.tensor([5, 5, 5]), torch.ones(3))
    torch.testing.assert_close(got, logits)
    assert sampling.apply_top_k_top_p(logits, None, None) is logits


# --- min-p ------------------------------------------------------------------------------------


def test_min_p_matches_naive():
    probs = [[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.6, 0.2, 0.05]]
    min_p = [0.3, 0.1]
    got = rows(sampling.apply_min_p(torch.tensor(probs), torch.tensor(min_p)))
    for row, m, out in zip(probs, min_p, got):
        want = [p if p >= m * max(row) else 0.0 for p in row]
        assert out == pytest.approx(want)
    assert got[0] == pytest.approx([0.5, 0.2, 0.15, 0.0, 0.0])
    off = sampling.apply_min_p(torch.tensor(probs), torch.zeros(2))
    torch.testing.assert_close(off, torch.tensor(probs))


# --- drawing ----------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_row_is_batch_independent():
    probs = torch.tensor(DIST)
    g_alone, g_batch = gen(7), gen(7)
    alone, batched = [], []
    for _ in range(30):
        alone.append(sampling.sample_rows(probs[1:2], [g_alone]).item())
        other = torch.softmax(torch.randn(3, 5), dim=-1)
        batch = torch.cat([other[:2], probs[1:2], other[2:]])
        out = sampling.sample_rows(batch, [None, gen(1), g_batch, None], gen(99))
        batched.append(out[2].item())
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize("row", DIST[:2])
def test_empirical_distribution_matches_probs(row):
    draws = 20000
    probs = torch.tensor([row]).repeat(draws, 1)
    tokens = sampling.sample_rows(probs, [None] * draws, gen(3)).tolist()
    counts = [tokens.count(t) for t in range(len(row))]
    total = sum(row)
    # 4 degrees of freedom: P(chi2 > 30) is about 5e-6
    assert chi_square(counts, [p / total for p in row]) < 30


def test_seeded_generator_distribution_matches_probs():
    row = [0.1, 0.0, 0.6, 0.3]
    g = gen(11)
    tokens = [sampling.sample_rows(torch.tensor([row]), [g]).item() for _ in range(3000)]
    counts = [tokens.count(t) for t in range(4)]
    assert counts[1] == 0
    assert chi_square(counts, row) < 25


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).repeat(5000, 1)
    tokens = set(sampling.sample_rows(probs, [None] * 5000, gen(5)).tolist())
    assert tokens == {1, 3}


def test_top_k_one_draw_is_argmax():
    logits = torch.randn(6, 50, generator=gen(2))
    masked = sampling.apply_top_k_top_p(logits, torch.ones(6, dtype=torch.long), None)
    drawn = sampling.sample_rows(masked.softmax(-1), [None, gen(1)] * 3, gen(0))
    assert drawn.tolist() == [max(range(50), key=lambda t: r[t]) for r in rows(logits)]


# --- logprobs ---------------------------------------------------------------------------------


def test_top_logprobs_matches_sorting_by_hand():
    logprobs = torch.log_softmax(torch.randn(3, 12, generator=gen(4)), dim=-1)
    values, ids = sampling.top_logprobs(logprobs, 4)
    assert values.shape == ids.shape == (3, 4)
    for r, v, i in zip(rows(logprobs), rows(values), ids.tolist()):
        want = sorted(range(12), key=lambda t: -r[t])[:4]
        assert i == want
        assert v == pytest.approx([r[t] for t in want])
