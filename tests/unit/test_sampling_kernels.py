"""raylane.kernels.sampling against direct, naive computations on small known distributions."""

from __future__ import annotations

import math

import pytest
import torch
from raylane.kernels import sampling

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


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
    got = sampling.apply_penalties(
        torch.tensor(logits),
        prompt_mask,
        counts,
        torch.tensor(reps),
        torch.tensor(presences),
        torch.tensor(freqs),
    )
    for i in range(2):
        want = naive_penalties(logits[i], prompts[i], outputs[i], reps[i], presences[i], freqs[i])
        assert rows(got)[i] == pytest.approx(want, abs=1e-6)


def test_neutral_penalties_leave_logits_unchanged():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.bool)
    counts = torch.full((3, 10), 2.0)
    got = sampling.apply_penalties(
        logits, mask, counts, torch.ones(3), torch.zeros(3), torch.zeros(3)
    )
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
        torch.tensor(LOGITS),
        torch.tensor(top_k) if top_k else None,
        torch.tensor(top_p) if top_p else None,
    )
    for i, row in enumerate(LOGITS):
        want = naive_keep(row, top_k[i] if top_k else None, top_p[i] if top_p else None)
        assert kept_ids(got)[i] == want


def test_top_p_boundaries_by_hand():
    logits = torch.tensor([LOGITS[0]] * 4)
    top_p = torch.tensor([0.5, 0.50001, 0.7, 0.96])
    # mass strictly above each token: 0, .5, .7, .85, .95
    assert kept_ids(sampling.apply_top_k_top_p(logits, None, top_p)) == [
        {0},
        {0, 1},
        {0, 1},
        {0, 1, 2, 3, 4},
    ]


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


# --- the counter-based random stream ----------------------------------------------------------


def py_philox(key: int, ctr0: int, ctr1: int) -> tuple[int, int]:
    """Philox2x32-10 on Python ints, which are exact: the reference for the int64 tensor ops."""
    for _ in range(10):
        product = 0xD256D193 * ctr0
        ctr0, ctr1 = (product >> 32) ^ key ^ ctr1, product & 0xFFFF_FFFF
        key = (key + 0x9E3779B9) & 0xFFFF_FFFF
    return ctr0, ctr1


def philox_rows(triples: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    key, ctr0, ctr1 = torch.tensor(triples, dtype=torch.long).unbind(1)
    words = sampling.philox2x32(key, ctr0, ctr1)
    return words[0].tolist(), words[1].tolist()


def test_philox_matches_the_random123_known_answers():
    # Random123's kat_vectors (the authors' library), here as (key, ctr0, ctr1) -> (out0, out1)
    got = philox_rows([(0, 0, 0), (0xFFFF_FFFF,) * 3, (0x13198A2E, 0x243F6A88, 0x85A308D3)])
    assert list(zip(*got)) == [
        (0xFF1DAE59, 0x6CD10DF2),
        (0x2C3F628B, 0xAB4FD7AD),
        (0xDD7CE038, 0xF62A4C12),
    ]


EDGES = [0, 1, 0xFFFF, 0x1_0000, 0x7FFF_FFFF, 0x8000_0000, 0xD256_D193, 0xFFFF_FFFE, 0xFFFF_FFFF]


def test_philox_matches_python_ints_near_the_word_limits():
    g = gen(8)
    randoms = torch.randint(0, 2**32, (200, 3), generator=g).tolist()
    triples = [(k, a, b) for k in EDGES for a in EDGES for b in EDGES[::2]] + randoms
    got = philox_rows(triples)
    assert list(zip(*got)) == [py_philox(*t) for t in triples]


def test_uniform_packs_53_bits_of_both_words():
    triples = [(k, a, 7) for k in EDGES for a in range(40)]
    key, ctr0, ctr1 = torch.tensor(triples, dtype=torch.long).unbind(1)
    got = sampling.philox_uniform(key, ctr0, ctr1).tolist()
    want = [((w0 >> 5) * 2**26 + (w1 >> 6)) / 2**53 for w0, w1 in (py_philox(*t) for t in triples)]
    assert got == want
    assert all(0 <= u < 1 for u in got) and any(int(u * 2**53) % 2 for u in got)


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)


def test_uniforms_are_uniform():
    u_ctr = torch.arange(20000)
    u = sampling.philox_uniform(torch.full_like(u_ctr, 99), u_ctr, torch.zeros_like(u_ctr))
    counts = torch.histc(u.float(), bins=10, min=0, max=1).tolist()
    # 9 degrees of freedom: P(chi2 > 35) is about 6e-5
    assert chi_square([int(c) for c in counts], [0.1] * 10) < 35


# --- the two-level exponential race ---------------------------------------------------------


def race(probs: torch.Tensor, key: int = 5, ctr0: int = 17, ctr1=None) -> list[int]:
    """Draw every row of `probs` with one key; `ctr1` defaults to the row number (a position)."""
    n = probs.shape[0]
    if not isinstance(ctr1, torch.Tensor):
        ctr1 = torch.arange(n) if ctr1 is None else torch.full((n,), ctr1)
    return sampling.sample_race(probs, torch.full((n,), key), torch.full((n,), ctr0), ctr1).tolist()


@pytest.mark.parametrize(
    "row",
    [
        DIST[0],
        DIST[1],
        [0.1, 0.0, 0.6, 0.3, 0.0],  # zeros between and last
        [3.0, 0.0, 1.0, 4.0],  # need not sum to 1
        # more than one block, most of the mass in the second block's tail
        [0.001] * 300 + [0.0] * 100 + [0.2, 0.3] + [0.0] * 111,
    ],
)
def test_draws_over_many_counters_follow_the_probs(row):
    draws = 20000
    tokens = race(torch.tensor([row]).repeat(draws, 1))
    counts = [tokens.count(t) for t in range(len(row))]
    total = sum(row)
    assert all(c == 0 for c, p in zip(counts, row) if p == 0)
    if len(row) > 10:  # pool the many small tokens into one bin
        small = [i for i, p in enumerate(row) if 0 < p < 0.01]
        big = [i for i, p in enumerate(row) if p >= 0.01]
        counts = [sum(counts[i] for i in small)] + [counts[i] for i in big]
        row = [sum(row[i] for i in small)] + [row[i] for i in big]
    # at most 4 degrees of freedom: P(chi2 > 30) is about 5e-6
    assert chi_square(counts, [p / total for p in row]) < 30


def test_a_draw_is_a_function_of_its_words_alone():
    probs = torch.randn(64, 700, generator=gen(6)).softmax(-1)
    again = race(probs.flip(0), ctr1=torch.arange(64).flip(0))[::-1]  # rows reordered
    assert race(probs) == race(probs.clone()) == again
    # another key, counter word or position gives other draws
    for kwargs in ({"key": 6}, {"ctr0": 18}, {"ctr1": 1000}):
        assert race(probs, **kwargs) != race(probs)


def test_last_bit_noise_in_the_logits_almost_never_changes_a_draw():
    """The point of the race over an inverse CDF: logits that differ in the last bits (another
    batch's or TP split's rounding) give the same tokens. An inverse-CDF draw (one uniform
    against a running sum over this 49k vocabulary) moves in a few percent of draws."""
    logits = torch.randn(400, 49152, generator=gen(7)) * 3
    noisy = logits + 1e-4 * torch.randn(logits.shape, generator=gen(8))
    probs, noisy = logits.softmax(-1), noisy.softmax(-1)
    same = sum(a == b for a, b in zip(race(probs, ctr1=3), race(noisy, ctr1=3)))
    assert same >= 398
    u = torch.rand(400, generator=gen(9), dtype=torch.float64)
    moved = (inverse_cdf(probs, u) != inverse_cdf(noisy, u)).sum().item()
    assert moved >= 5  # the data does tell the two kinds of draw apart


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)


def test_top_k_one_draw_is_argmax():
    logits = torch.randn(6, 50, generator=gen(2))
    masked = sampling.apply_top_k_top_p(logits, torch.ones(6, dtype=torch.long), None)
    drawn = race(masked.softmax(-1))
    assert drawn == [max(range(50), key=lambda t: r[t]) for r in rows(logits)]


# --- logprobs ---------------------------------------------------------------------------------


def test_top_logprobs_matches_sorting_by_hand():
    logprobs = torch.log_softmax(torch.randn(3, 12, generator=gen(4)), dim=-1)
    values, ids = sampling.top_logprobs(logprobs, 4)
    assert values.shape == ids.shape == (3, 4)
    for r, v, i in zip(rows(logprobs), rows(values), ids.tolist()):
        want = sorted(range(12), key=lambda t: -r[t])[:4]
        assert i == want
        assert v == pytest.approx([r[t] for t in want])
