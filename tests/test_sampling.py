"""Tests for tandem.sampling: warping, truncation, and the losslessness of speculative verification.

The central test enumerates every branch of speculative decoding over a tiny vocab and checks that the exact
distribution of emitted tokens equals the target's own autoregressive distribution; a broken rule run through
the same enumerator must fail, which shows the check has teeth. A seeded chi-square test then exercises the
real verify_stochastic code path.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from tandem.acceptance import (
    ArgmaxRows,
    VerifyOutcome,
    WarpedRows,
    acceptance_probability,
    residual_distribution,
    verify_greedy,
    verify_stochastic,
)
from tandem.convert import dist_from_pb
from tandem.errors import InvalidArgument
from tandem.sampling import (
    SamplingParams,
    SparseDist,
    _inverse_cdf,
    _near_inverse_cdf,
    _temperature_weights,
    _tie_closed_top,
    _top_candidates,
    draft_distribution,
    sample,
    sample_logits,
    truncate,
    warp,
)
from tandem.v1 import tandem_pb2 as pb

AcceptFn = Callable[[np.ndarray, SparseDist | None, int], float]
ResidualFn = Callable[[np.ndarray, SparseDist | None, int], np.ndarray]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ----------------------------------------------------------------------------------------------------
# warp
# ----------------------------------------------------------------------------------------------------


def test_greedy_is_one_hot_at_lowest_argmax() -> None:
    logits = np.array([0.5, 3.0, -1.0, 3.0, 2.0])
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-6, top_k=3, top_p=0.5),
        SamplingParams(temperature=-1.0),
    ):
        assert params.greedy
        np.testing.assert_array_equal(warp(logits, params), [0.0, 1.0, 0.0, 0.0, 0.0])
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_temperature_scaling_equals_softmax_to_float32_precision(dtype: type) -> None:
    """Plain temperature sampling takes its exponentials in float32 (see `_temperature_softmax`): each probability
    within 1e-5 of the float64 softmax relatively, the whole distribution within 1e-7 in total variation."""
    logits = (np.random.default_rng(5).normal(scale=3.0, size=49152)).astype(dtype)
    for t in (0.3, 0.7, 1.0, 1.7):
        out = warp(logits, SamplingParams(temperature=t))
        exact = softmax(logits.astype(np.float64) / t)
        assert out.dtype == np.float64 and out.sum() == pytest.approx(1.0, abs=1e-12)
        normal = exact > 1e-30  # below float32's normal range the relative error grows, and past it the value is 0
        np.testing.assert_allclose(out[normal], exact[normal], rtol=1e-5)
        assert 0.5 * np.abs(out - exact).sum() < 1e-7
        assert int(np.argmax(out)) == int(np.argmax(exact))


def test_top_k_keeps_exactly_k_on_distinct_logits() -> None:
    rng = np.random.default_rng(1)
    logits = rng.permutation(np.arange(50, dtype=np.float64)) * 0.1
    for k in (1, 2, 7, 49):
        out = warp(logits, SamplingParams(top_k=k, temperature=0.8))
        kept = np.flatnonzero(out)
        assert kept.size == k
        np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-logits)[:k]))
        np.testing.assert_allclose(out[kept], softmax(logits[kept] / 0.8), rtol=1e-12)
    # top_k >= V is the same as disabled: plain temperature sampling, float32 exponentials
    np.testing.assert_array_equal(warp(logits, SamplingParams(top_k=50)), warp(logits, SamplingParams()))
    np.testing.assert_array_equal(warp(logits, SamplingParams(top_k=500)), warp(logits, SamplingParams()))
    np.testing.assert_allclose(warp(logits, SamplingParams(top_k=50)), softmax(logits), rtol=1e-5)


def test_top_p_keeps_minimal_prefix() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    cases = {
        0.0: [0.0, 1.0, 0.0, 0.0],  # always at least one token
        0.3: [0.0, 1.0, 0.0, 0.0],
        0.4: [0.0, 1.0, 0.0, 0.0],  # 0.4 already reaches 0.4
        0.41: [0.0, 4 / 7, 0.0, 3 / 7],
        0.7: [0.0, 4 / 7, 0.0, 3 / 7],  # 0.4 + 0.3 reaches 0.7 (up to rounding)
        0.75: [0.0, 4 / 9, 2 / 9, 3 / 9],
        0.9: [0.0, 4 / 9, 2 / 9, 3 / 9],
        0.95: [0.1, 0.4, 0.2, 0.3],
    }
    for top_p, expected in cases.items():
        np.testing.assert_allclose(warp(logits, SamplingParams(top_p=top_p)), expected, atol=1e-15, err_msg=top_p)


def test_top_p_applies_after_temperature() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    # T=0.5 squares and renormalises: [1, 16, 4, 9] / 30 -> 16/30 + 9/30 = 25/30 >= 0.8 keeps two tokens
    np.testing.assert_allclose(
        warp(logits, SamplingParams(temperature=0.5, top_p=0.8)), [0.0, 16 / 25, 0.0, 9 / 25], atol=1e-15
    )


def test_top_k_then_top_p_on_renormalised() -> None:
    logits = np.log(np.array([0.35, 0.3, 0.2, 0.15]))
    # top-p alone at 0.7 needs three tokens (0.35 + 0.3 = 0.65 < 0.7)
    np.testing.assert_allclose(
        warp(logits, SamplingParams(top_p=0.7)), np.array([0.35, 0.3, 0.2, 0.0]) / 0.85, atol=1e-15
    )
    # top-k=3 first renormalises to [0.41, 0.35, 0.24], so top-p 0.7 is reached with two tokens
    np.testing.assert_allclose(
        warp(logits, SamplingParams(top_k=3, top_p=0.7)), np.array([0.35, 0.3, 0.0, 0.0]) / 0.65, atol=1e-15
    )


def test_top_k_boundary_ties_do_not_lose_the_kth_token() -> None:
    out = warp(np.array([1.0, 2.0, 2.0, 0.0]), SamplingParams(top_k=1))
    assert set(np.flatnonzero(out)) <= {1, 2} and np.flatnonzero(out).size >= 1
    assert out.sum() == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_warp_invariants_on_large_vocab(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = rng.normal(scale=4.0, size=vocab)
    logits[rng.choice(vocab, size=100, replace=False)] = -np.inf  # masked tokens
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.2, top_p=0.999),
        SamplingParams(temperature=1.0, top_p=0.995),  # nucleus larger than the first candidate batch
        SamplingParams(temperature=0.9, top_k=40, top_p=0.8),
        SamplingParams(top_p=1e-9),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.0),
    ):
        out = warp(logits, params)
        assert out.dtype == np.float64 and out.shape == (vocab,)
        assert out.sum() == pytest.approx(1.0, abs=1e-12)
        assert np.all(out >= 0.0)
        support = np.flatnonzero(out)
        assert support.size >= 1
        # the support is a top set of the logits, and inside it probabilities follow softmax(logits / T)
        outside = np.setdiff1d(np.arange(vocab), support)
        assert logits[support].min() >= logits[outside].max()
        assert np.isinf(logits[outside]).sum() == 100 and np.all(out[np.isinf(logits)] == 0.0)
        if not params.greedy:
            plain = params.top_k == 0 and params.top_p == 1.0  # float32 exponentials (see _temperature_softmax)
            np.testing.assert_allclose(
                out[support],
                softmax(logits[support] / params.temperature),
                rtol=1e-5 if plain else 1e-9,
                atol=1e-30 if plain else 1e-300,
            )
        if params.top_k:
            assert support.size <= params.top_k
        if params.top_p < 1.0 and not params.greedy:
            # minimal: dropping the smallest kept token falls below top_p (on the pre-top-p distribution)
            base = warp(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
            kept = np.sort(base[support])
            assert kept.sum() >= params.top_p - 1e-12
            assert kept[1:].sum() < params.top_p


def test_warp_is_fast_with_top_k() -> None:
    logits = np.random.default_rng(2).normal(size=262144)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    warp(logits, params)
    best = min(_timed(lambda: warp(logits, params)) for _ in range(5))
    assert best < 0.05, f"warp took {best * 1e3:.1f} ms"


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError):
        warp(np.array([np.nan, 1.0]), SamplingParams())
    with pytest.raises(ValueError):
        warp(np.full(3, -np.inf), SamplingParams())


# ----------------------------------------------------------------------------------------------------
# truncate / SparseDist / sample
# ----------------------------------------------------------------------------------------------------


def test_truncate_exact_values() -> None:
    p = np.array([0.1, 0.4, 0.2, 0.3])
    q = truncate(p, 2)
    np.testing.assert_array_equal(q.token_ids, [1, 3])
    np.testing.assert_allclose(q.probs, [4 / 7, 3 / 7], rtol=1e-15)
    assert q.token_ids.dtype == np.int64 and q.probs.dtype == np.float64
    q3 = truncate(p, 3)
    np.testing.assert_array_equal(q3.token_ids, [1, 3, 2])
    np.testing.assert_allclose(q3.probs, [4 / 9, 3 / 9, 2 / 9], rtol=1e-15)


def test_truncate_drops_zeros_and_breaks_ties_by_id() -> None:
    p = np.array([0.0, 0.25, 0.5, 0.25, 0.0])
    full = truncate(p, 10)
    np.testing.assert_array_equal(full.token_ids, [2, 1, 3])
    np.testing.assert_allclose(full.probs, [0.5, 0.25, 0.25])
    two = truncate(p, 2)
    np.testing.assert_array_equal(two.token_ids, [2, 1])
    np.testing.assert_allclose(two.probs, [2 / 3, 1 / 3])
    with pytest.raises(ValueError):
        truncate(p, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_draft_distribution_is_the_truncated_warp(dtype: type) -> None:
    """The fast path keeps the tokens of truncate(warp(...)) in the same order, with probabilities equal to rounding;
    what it cannot take fast (top-p, top-k below the support, greedy) gives exactly the full path."""

    rng = np.random.default_rng(11)
    for _ in range(20):
        logits = rng.normal(scale=3.0, size=49152).astype(dtype)
        for params, support in (
            (SamplingParams(temperature=0.7), 32),
            (SamplingParams(temperature=1.3, top_k=40), 32),
            (SamplingParams(temperature=0.2, top_k=32), 32),
            (SamplingParams(temperature=1.0), 1),
        ):
            fast, full = draft_distribution(logits, params, support), truncate(warp(logits, params), support)
            np.testing.assert_array_equal(fast.token_ids, full.token_ids)
            np.testing.assert_allclose(fast.probs, full.probs, rtol=1e-5)
        for params, support in (
            (SamplingParams(temperature=0.7, top_p=0.9), 32),
            (SamplingParams(temperature=0.7, top_k=5), 32),
            (SamplingParams(temperature=0.0), 32),
        ):
            fast, full = draft_distribution(logits, params, support), truncate(warp(logits, params), support)
            np.testing.assert_array_equal(fast.token_ids, full.token_ids)
            np.testing.assert_array_equal(fast.probs, full.probs)
    small = np.array([0.5, 2.0, 1.0], dtype=np.float32)  # support >= vocabulary: the full path
    np.testing.assert_array_equal(
        draft_distribution(small, SamplingParams(), 8).probs, truncate(warp(small, SamplingParams()), 8).probs
    )
    with pytest.raises(ValueError):
        draft_distribution(small, SamplingParams(), 0)


def test_top_candidates_is_the_tie_closed_top() -> None:
    """The windowed search returns exactly the tie-closed top n, whether the n-th value lies in the first window, in
    a widened one, or beyond every window (the whole-row fallback), with ties at the cut and -inf logits."""
    rng = np.random.default_rng(5)
    rows = [rng.normal(scale=scale, size=5000).astype(np.float32) for scale in (0.5, 3.0, 10.0, 40.0, 400.0)]
    tied = np.zeros(5000, dtype=np.float32)
    tied[[3, 4000]] = 50.0  # two leaders far above 4998 tied tokens: the cut falls among the ties
    spiky = np.full(5000, -np.inf, dtype=np.float32)
    spiky[rng.choice(5000, 300, replace=False)] = rng.normal(scale=30.0, size=300)
    for row in [*rows, tied, spiky, rows[1].astype(np.float64)]:
        for n in (1, 7, 256, 4999, 5000, 6000):
            got = _top_candidates(row, float(row.max()), n)
            want = np.sort(_tie_closed_top(row, n))
            np.testing.assert_array_equal(got, want)


def test_dist_from_pb_checks_what_the_wire_brings() -> None:
    """A draft distribution from the wire is renormalised in float64, and anything a draft could not have sampled from
    is refused with InvalidArgument (the servicer's INVALID_ARGUMENT), not built."""
    q = dist_from_pb(pb.SparseDistribution(token_ids=[9, 2, 4], probs=[0.5, 0.25, 0.25000003]), n_vocab=10)
    np.testing.assert_array_equal(q.token_ids, [9, 2, 4])
    assert q.probs.dtype == np.float64 and abs(float(q.probs.sum()) - 1.0) < 1e-15
    with pytest.raises(ValueError):
        q.probs[0] = 1.0  # read-only, as SparseDist's own constructor makes it
    for ids, probs in (
        ([], []),
        ([1, 2], [1.0]),
        ([1, 1], [0.5, 0.5]),
        ([1, 10], [0.5, 0.5]),
        ([-1, 2], [0.5, 0.5]),
        ([1, 2], [0.0, 0.0]),
        ([1, 2], [-0.5, 1.5]),
        ([1, 2], [float("nan"), 1.0]),
        ([1, 2], [float("inf"), 1.0]),
    ):
        with pytest.raises(InvalidArgument):
            dist_from_pb(pb.SparseDistribution(token_ids=ids, probs=probs), n_vocab=10)


def test_draft_distribution_breaks_ties_by_lowest_id() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    logits[[900, 10, 500]] = 5.0  # three tied leaders, then 997 tied tokens
    q = draft_distribution(logits, SamplingParams(temperature=0.5), 5)
    np.testing.assert_array_equal(q.token_ids, [10, 500, 900, 0, 1])
    np.testing.assert_allclose(
        q.probs, np.array([1, 1, 1, np.exp(-10), np.exp(-10)]) / (3 + 2 * np.exp(-10)), rtol=1e-12
    )


def test_sparse_dist() -> None:
    q = SparseDist(token_ids=np.array([7, 2]), probs=np.array([0.25, 0.75]))
    assert q.prob_of(7) == 0.25 and q.prob_of(2) == 0.75 and q.prob_of(3) == 0.0
    np.testing.assert_array_equal(q.dense(8), [0, 0, 0.75, 0, 0, 0, 0, 0.25])
    with pytest.raises(ValueError):
        q.dense(5)
    with pytest.raises(ValueError):
        q.token_ids[0] = 1  # read-only: q must not change after it was sent
    for ids, probs in (([1, 1], [0.5, 0.5]), ([1, 2], [0.5, 0.6]), ([1], [0.5, 0.5]), ([-1], [1.0])):
        with pytest.raises(ValueError):
            SparseDist(token_ids=np.array(ids), probs=np.array(probs))


def test_sample_never_returns_zero_probability_tokens() -> None:
    rng = np.random.default_rng(3)
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = {sample(p, rng) for _ in range(2000)}
    assert draws == {1, 3}
    q = SparseDist(token_ids=np.array([9, 4]), probs=np.array([1.0, 0.0]))
    assert {sample(q, rng) for _ in range(200)} == {9}


class _FixedUniform:
    """Stands in for a Generator to hit the CDF edges (u = 0 and the largest u below 1) deterministically."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def test_sample_cdf_edges() -> None:
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    top = float(np.nextafter(1.0, 0.0))
    assert sample(p, _FixedUniform(0.0)) == 1  # type: ignore[arg-type]
    assert sample(p, _FixedUniform(0.25)) == 3  # type: ignore[arg-type]
    assert sample(p, _FixedUniform(top)) == 3  # type: ignore[arg-type]
    q = SparseDist(token_ids=np.array([8, 5, 2]), probs=np.array([0.0, 1.0, 0.0]))
    assert sample(q, _FixedUniform(0.0)) == 5  # type: ignore[arg-type]
    assert sample(q, _FixedUniform(top)) == 5  # type: ignore[arg-type]


def test_sample_large_vocab_inverts_the_cdf_exactly() -> None:
    """Large distributions are inverted in two levels (block sums, then one block): for every u the token is the
    one whose CDF interval holds u, as a flat cumsum finds it, and zero-probability tokens and blocks never come out
    (including the largest u below 1 and a distribution whose last blocks have no mass)."""
    rng = np.random.default_rng(11)
    p = rng.random(5000) ** 8
    p[rng.random(5000) < 0.5] = 0.0
    p[4000:] = 0.0  # trailing blocks without mass
    p /= p.sum()
    cum = np.cumsum(p)
    for u in [0.0, float(np.nextafter(1.0, 0.0)), *rng.random(3000)]:
        token = sample(p, _FixedUniform(u))  # type: ignore[arg-type]
        assert p[token] > 0.0
        lower = cum[token - 1] if token else 0.0
        assert lower - 1e-12 <= u <= cum[token] + 1e-12, (u, token)


def _boundary_distance(p: np.ndarray, u: float) -> float:
    """How far u lies from the nearest boundary of p's CDF intervals (p sums to 1)."""
    cum = np.concatenate(([0.0], np.cumsum(p)))
    return float(np.min(np.abs(cum - u)))


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.8])
def test_sample_logits_draws_what_sample_of_warp_draws(temperature: float) -> None:
    """The plain-temperature fast path inverts the same CDF as `sample(warp(...))`: for the same uniform it returns
    the same token, except where u lies within rounding of a CDF boundary (none of these 4,000 draws did)."""
    rng = np.random.default_rng(int(temperature * 10))
    params = SamplingParams(temperature=temperature)
    for row in range(4):
        logits = (rng.standard_normal(49_152) * 3).astype(np.float32)
        logits[rng.integers(0, logits.size, 40)] += 12.0  # a few likely tokens, as a language model's row has
        p = warp(logits, params)
        for u in [0.0, float(np.nextafter(1.0, 0.0)), *rng.random(1000)]:
            fast = sample_logits(logits, params, _FixedUniform(u))  # type: ignore[arg-type]
            reference = sample(p, _FixedUniform(u))  # type: ignore[arg-type]
            if fast != reference:
                assert _boundary_distance(p, u) < 1e-12, (row, u, fast, reference)
            assert p[fast] > 0.0


def test_sample_logits_other_settings_take_the_warp() -> None:
    """Top-p, top-k and float64 logits: the same token as `sample(warp(...))` for every uniform; greedy: the argmax,
    drawing nothing."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(3000).astype(np.float32) * 4
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.5),
    ):
        p = warp(logits, params)
        for u in rng.random(300):
            assert sample_logits(logits, params, _FixedUniform(u)) == sample(p, _FixedUniform(u))  # type: ignore[arg-type]
    plain = SamplingParams(temperature=0.9)
    p64 = warp(logits.astype(np.float64), plain)
    for u in rng.random(300):
        token = sample_logits(logits.astype(np.float64), plain, _FixedUniform(u))  # type: ignore[arg-type]
        reference = sample(p64, _FixedUniform(u))  # type: ignore[arg-type]
        assert token == reference or _boundary_distance(p64, u) < 1e-12
    draws = np.random.default_rng(1)
    assert sample_logits(logits, SamplingParams(temperature=0.0), draws) == int(np.argmax(logits))
    assert draws.random() == np.random.default_rng(1).random()  # greedy drew nothing


def test_sample_logits_draws_one_uniform_and_matches_frequencies() -> None:
    """One uniform per token (callers rely on the RNG stream), and over 40,000 draws each token's frequency is within
    5 standard errors of its warped probability."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * 1500, dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    p = warp(logits, params)
    rng, reference = np.random.default_rng(7), np.random.default_rng(7)
    counts = np.zeros(p.size)
    n = 40_000
    for _ in range(n):
        counts[sample_logits(logits, params, rng)] += 1
    reference.random(n)
    assert rng.random() == reference.random()
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) <= 5 * sigma + 1e-12)


def _near_and_whole(logits: np.ndarray, temperature: float, u: float) -> tuple[int | None, int]:
    """`_near_inverse_cdf` and the whole-vocabulary inverse CDF it stands in for, at the same uniform."""
    top = float(logits.max())
    near = _near_inverse_cdf(logits, top, temperature, u)
    whole = _inverse_cdf(_temperature_weights(logits, top, temperature), _FixedUniform(u), u)  # type: ignore[arg-type]
    return near, whole


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0])
def test_near_inverse_cdf_settles_most_draws_as_the_whole_cdf_would(temperature: float) -> None:
    """Rows shaped like a language model's (a few likely tokens above a wide tail): the near tokens settle almost
    every draw, and each settled draw is the token the whole CDF gives for the same uniform (up to rounding at a
    boundary, which none of these 6,000 draws met)."""
    rng = np.random.default_rng(int(temperature * 100))
    settled = 0
    for row in range(3):
        logits = (rng.standard_normal(49_152) * 2).astype(np.float32)  # the tail, some of it near at T=1
        logits[rng.integers(0, logits.size, 200)] = rng.uniform(10.0, 24.0, 200).astype(np.float32)
        p = warp(logits, SamplingParams(temperature=temperature))
        for u in [0.0, float(np.nextafter(1.0, 0.0)), *rng.random(2000)]:
            near, whole = _near_and_whole(logits, temperature, u)
            if near is not None:
                settled += 1
                assert near == whole or _boundary_distance(p, u) < 1e-12, (row, u, near, whole)
    assert settled >= 0.95 * 3 * 2002


def test_near_inverse_cdf_leaves_far_tokens_and_flat_rows_to_the_whole_cdf() -> None:
    """A draw that lands on a far token (the tail past the near mass, or a far token before the first near one at
    u = 0) and a row where most tokens are near are not settled; the whole CDF, which sample_logits falls back to
    with the same uniform, returns the far token."""
    logits = np.full(20_000, -21.0, dtype=np.float32)  # far: e^-21 of the top each, together ~1.5e-5 of the mass
    logits[[5, 700, 9000]] = [0.0, -0.5, -2.0]
    temperature = 1.0
    near, whole = _near_and_whole(logits, temperature, 0.0)
    assert near is None and whole == 0  # token 0 is far and has weight: the first CDF interval is its
    u_tail = float(np.nextafter(1.0, 0.0))
    near, whole = _near_and_whole(logits, temperature, u_tail)
    assert near is None and whole not in (5, 700, 9000)
    assert sample_logits(logits, SamplingParams(temperature=temperature), _FixedUniform(u_tail)) == whole  # type: ignore[arg-type]
    for u in (0.01, 0.4, 0.9):
        near, whole = _near_and_whole(logits, temperature, u)
        assert near == whole and near in (5, 700, 9000)
    flat = np.zeros(4096, dtype=np.float32)
    assert _near_and_whole(flat, temperature, 0.3) == (None, int(0.3 * 4096))


def test_warped_rows_sample_matches_the_warped_row() -> None:
    rng = np.random.default_rng(9)
    rows = (rng.standard_normal((3, 49_152)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.7)
    probs = WarpedRows(rows, params)
    for u in rng.random(200):
        reference = sample(warp(rows[2], params), _FixedUniform(u))  # type: ignore[arg-type]
        token = probs.sample(2, _FixedUniform(u))  # type: ignore[arg-type]
        assert token == reference or _boundary_distance(warp(rows[2], params), u) < 1e-12
    assert probs.warped == 0  # drawn without warping the row
    probs[1]
    assert probs.sample(1, _FixedUniform(0.5)) == sample(probs[1], _FixedUniform(0.5))  # type: ignore[arg-type]


def test_acceptance_and_residual_small_cases() -> None:
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = SparseDist(token_ids=np.array([0, 1, 3]), probs=np.array([0.25, 0.6, 0.15]))
    assert acceptance_probability(p, q, 0) == 1.0
    assert acceptance_probability(p, q, 1) == pytest.approx(0.5)
    assert acceptance_probability(p, q, 3) == 0.0
    assert acceptance_probability(p, None, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        acceptance_probability(p, q, 2)  # q(2) == 0: could never have been drafted
    # max(0, p - q) = [0.25, 0, 0.2, 0] -> /0.45
    np.testing.assert_allclose(residual_distribution(p, q, 1), [0.25 / 0.45, 0.0, 0.2 / 0.45, 0.0])
    np.testing.assert_allclose(residual_distribution(p, None, 0), [0.0, 0.6, 0.4, 0.0])
    # zero residual mass falls back to p
    same = SparseDist(token_ids=np.array([0, 1, 2]), probs=p[:3])
    np.testing.assert_array_equal(residual_distribution(p, same, 0), p)


# ----------------------------------------------------------------------------------------------------
# Exact losslessness by enumeration
# ----------------------------------------------------------------------------------------------------

V = 4
LENGTH = 3


@dataclass(frozen=True)
class Scenario:
    name: str
    target: SamplingParams
    draft: SamplingParams | None  # None => deterministic draft: argmax of draft logits, q None
    max_support: int = V  # the draft samples from truncate(warp(...), max_support)


SCENARIOS = [
    Scenario("both_t1", SamplingParams(), SamplingParams()),
    Scenario("different_temperatures", SamplingParams(temperature=0.6), SamplingParams(temperature=1.7)),
    Scenario("truncated_draft", SamplingParams(temperature=0.9), SamplingParams(temperature=1.2), max_support=2),
    Scenario("target_top_k", SamplingParams(top_k=2), SamplingParams()),
    Scenario("draft_top_k", SamplingParams(temperature=1.3), SamplingParams(top_k=2)),
    Scenario("target_top_p", SamplingParams(top_p=0.7), SamplingParams(temperature=0.8)),
    Scenario("draft_top_p", SamplingParams(), SamplingParams(top_p=0.6)),
    Scenario("both_top_k_top_p", SamplingParams(top_k=3, top_p=0.8), SamplingParams(top_k=2, top_p=0.9)),
    Scenario("greedy_target_sampled_draft", SamplingParams(temperature=0.0), SamplingParams(temperature=1.1)),
    Scenario("sampled_target_deterministic_draft", SamplingParams(temperature=0.9), None),
    Scenario("top_p_target_deterministic_draft", SamplingParams(top_p=0.8), None),
    Scenario("greedy_both_deterministic", SamplingParams(temperature=0.0), None),
    Scenario("greedy_both_one_hot_q", SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)),
]


def _logits(salt: int, prefix: tuple[int, ...]) -> np.ndarray:
    """A random 'model': logits are a fixed function of (model, prefix), independent across prefixes."""
    return np.random.default_rng([salt, len(prefix), *prefix]).normal(scale=1.5, size=V)


def target_dist_fn(sc: Scenario) -> Callable[[tuple[int, ...]], np.ndarray]:
    return cache(lambda prefix: warp(_logits(11, prefix), sc.target))


def draft_fn(sc: Scenario) -> Callable[[tuple[int, ...]], list[tuple[int, SparseDist | None, float]]]:
    """(draft token, q sent to the verifier, probability the draft proposes that token)."""

    @cache
    def proposals(prefix: tuple[int, ...]) -> list[tuple[int, SparseDist | None, float]]:
        logits = _logits(22, prefix)
        if sc.draft is None:
            return [(int(np.argmax(logits)), None, 1.0)]
        q = truncate(warp(logits, sc.draft), sc.max_support)
        return [(int(t), q, float(w)) for t, w in zip(q.token_ids, q.probs, strict=True) if w > 0.0]

    return proposals


def emitted_distribution(
    sc: Scenario,
    k: int,
    accept_fn: AcceptFn = acceptance_probability,
    residual_fn: ResidualFn = residual_distribution,
    target: Callable[[tuple[int, ...]], np.ndarray] | None = None,
    draft: Callable[[tuple[int, ...]], list[tuple[int, SparseDist | None, float]]] | None = None,
) -> np.ndarray:
    """Exact probability of each sequence of the first LENGTH emitted tokens under speculative decoding.

    Walks every branch of repeated rounds: draft choice (weighted by q), accept / reject (weighted by
    accept_fn), recovered token (weighted by residual_fn) and bonus token (weighted by p). A draft is only
    consulted for position i once d_1..d_{i-1} were accepted, which is the same joint law as drafting all k
    tokens up front, because later drafts are discarded on rejection. Branches stop once LENGTH tokens exist:
    what follows cannot change the first LENGTH tokens. `target` / `draft` replace the scenario's (masked tests).
    """
    target = target or target_dist_fn(sc)
    draft = draft or draft_fn(sc)
    out = np.zeros((V,) * LENGTH)

    def emit(seq: tuple[int, ...], w: float) -> None:
        if len(seq) >= LENGTH:
            out[seq[:LENGTH]] += w
        else:
            step(seq, 0, w)  # next round

    def step(seq: tuple[int, ...], i: int, w: float) -> None:
        """seq = context + drafts accepted so far in this round; i = index of the next draft."""
        if len(seq) >= LENGTH:
            emit(seq, w)
            return
        p = target(seq)
        if i == k:  # all drafts accepted: bonus token from p_k
            for t in np.flatnonzero(p):
                emit((*seq, int(t)), w * p[t])
            return
        for d, q, wq in draft(seq):
            a = accept_fn(p, q, d)
            assert 0.0 <= a <= 1.0, f"acceptance probability {a} is not a probability"
            if a > 0.0:
                step((*seq, d), i + 1, w * wq * a)
            if a < 1.0:
                r = residual_fn(p, q, d)
                assert np.all(r >= 0.0) and r.sum() == pytest.approx(1.0)
                for t in np.flatnonzero(r):
                    emit((*seq, int(t)), w * wq * (1.0 - a) * r[t])

    step((), 0, 1.0)
    return out


def autoregressive_distribution(
    sc: Scenario, target: Callable[[tuple[int, ...]], np.ndarray] | None = None
) -> np.ndarray:
    """Ground truth: the product of the target's warped conditionals."""
    target = target or target_dist_fn(sc)
    out = np.zeros((V,) * LENGTH)
    for seq in itertools.product(range(V), repeat=LENGTH):
        out[seq] = math.prod(target(seq[:i])[seq[i]] for i in range(LENGTH))
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_speculative_decoding_is_exactly_lossless(sc: Scenario, k: int) -> None:
    expected = autoregressive_distribution(sc)
    got = emitted_distribution(sc, k)
    assert expected.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.max(np.abs(got - expected)) < 1e-9


def _allowed(prefix: tuple[int, ...]) -> np.ndarray:
    """A toy grammar over the V tokens: t may follow `prefix` unless (sum(prefix) + t) % V == 0 (3 of 4 allowed)."""
    return np.array([(sum(prefix) + t) % V != 0 for t in range(V)])


def _masked(logits: np.ndarray, prefix: tuple[int, ...]) -> np.ndarray:
    return np.where(_allowed(prefix), logits, -np.inf)


def masked_target_fn(sc: Scenario) -> Callable[[tuple[int, ...]], np.ndarray]:
    """The constrained target: its logits masked first, then warped (temperature, top-k, top-p), as the target does
    (tandem.grammar): truncation then never leaves no valid token."""
    return cache(lambda prefix: warp(_masked(_logits(11, prefix), prefix), sc.target))


def masked_draft_fn(sc: Scenario) -> Callable[[tuple[int, ...]], list[tuple[int, SparseDist | None, float]]]:
    """A draft that knows the grammar: its q masked the same way."""

    @cache
    def proposals(prefix: tuple[int, ...]) -> list[tuple[int, SparseDist | None, float]]:
        logits = _masked(_logits(22, prefix), prefix)
        if sc.draft is None:
            return [(int(np.argmax(logits)), None, 1.0)]
        q = truncate(warp(logits, sc.draft), sc.max_support)
        return [(int(t), q, float(w)) for t, w in zip(q.token_ids, q.probs, strict=True) if w > 0.0]

    return proposals


@pytest.mark.parametrize("draft_knows_grammar", [False, True], ids=["unmasked draft", "masked draft"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_constrained_speculative_decoding_is_exactly_lossless(sc: Scenario, k: int, draft_knows_grammar: bool) -> None:
    """With a grammar, the target's p is masked then warped; a draft that ignores the grammar proposes forbidden
    tokens, which p rejects with probability 1. The emitted sequences then have exactly the constrained target
    distribution, and every one of them obeys the grammar."""
    target = masked_target_fn(sc)
    draft = masked_draft_fn(sc) if draft_knows_grammar else None
    expected = autoregressive_distribution(sc, target)
    got = emitted_distribution(sc, k, target=target, draft=draft)
    assert expected.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.max(np.abs(got - expected)) < 1e-9
    for seq in zip(*np.nonzero(got), strict=True):
        assert all(_allowed(tuple(int(t) for t in seq[:i]))[seq[i]] for i in range(LENGTH)), seq
    unconstrained = target_dist_fn(sc)  # the grammar bites: it moves the target's distribution somewhere
    prefixes = [pre for n in range(LENGTH) for pre in itertools.product(range(V), repeat=n)]
    assert any(np.max(np.abs(target(pre) - unconstrained(pre))) > 0.01 for pre in prefixes)


def test_an_unmasked_draft_proposes_forbidden_tokens() -> None:
    """Guards the constrained test: the draft that ignores the grammar does propose tokens the grammar forbids."""
    sc = SCENARIOS[0]
    draft = draft_fn(sc)
    forbidden = [
        d for n in range(LENGTH) for pre in itertools.product(range(V), repeat=n) for d, _, _ in draft(pre)
        if not _allowed(pre)[d]
    ]  # fmt: skip
    assert forbidden


def test_scenarios_are_not_trivial() -> None:
    """Guards the lossless test: drafts must actually get rejected sometimes, and warping must bite."""
    for sc in SCENARIOS:
        target, draft = target_dist_fn(sc), draft_fn(sc)
        rejection = [
            sum(wq * (1.0 - acceptance_probability(target(pre), q, d)) for d, q, wq in draft(pre))
            for n in range(LENGTH)
            for pre in itertools.product(range(V), repeat=n)
        ]
        assert max(rejection) > 0.05, sc.name
        if sc.target.top_k or sc.target.top_p < 1.0:
            assert any(np.count_nonzero(target(pre)) < V for pre in itertools.product(range(V), repeat=2))


def _accept_ignoring_q(p: np.ndarray, q: SparseDist | None, token: int) -> float:
    return float(p[token])


def _residual_is_p(p: np.ndarray, q: SparseDist | None, token: int) -> np.ndarray:
    return np.asarray(p, dtype=np.float64).copy()


def _residual_swapped(p: np.ndarray, q: SparseDist | None, token: int) -> np.ndarray:
    qd = np.eye(p.size)[token] if q is None else q.dense(p.size)
    r = np.maximum(0.0, qd - p)
    return r / r.sum() if r.sum() > 0 else p.copy()


def _accept_without_min(p: np.ndarray, q: SparseDist | None, token: int) -> float:
    return float(p[token]) / (1.0 if q is None else q.prob_of(token))


@pytest.mark.parametrize(
    ("scenario", "accept_fn", "residual_fn"),
    [
        ("both_t1", _accept_ignoring_q, residual_distribution),
        ("both_t1", acceptance_probability, _residual_is_p),
        ("different_temperatures", acceptance_probability, _residual_swapped),
        ("sampled_target_deterministic_draft", acceptance_probability, _residual_is_p),
        ("truncated_draft", _accept_ignoring_q, _residual_is_p),
    ],
)
def test_broken_rules_fail_the_exact_check(scenario: str, accept_fn: AcceptFn, residual_fn: ResidualFn) -> None:
    sc = next(s for s in SCENARIOS if s.name == scenario)
    expected = autoregressive_distribution(sc)
    assert np.max(np.abs(emitted_distribution(sc, 2) - expected)) < 1e-9  # the correct rule passes here
    got = emitted_distribution(sc, 2, accept_fn, residual_fn)
    assert np.max(np.abs(got - expected)) > 1e-3


def test_broken_rules_fail_via_monkeypatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same idea, patching the module so the enumerator's default arguments are bypassed too."""
    import tandem.acceptance as acceptance

    sc = SCENARIOS[0]
    monkeypatch.setattr(acceptance, "residual_distribution", _residual_is_p)
    got = emitted_distribution(sc, 1, acceptance.acceptance_probability, acceptance.residual_distribution)
    assert np.max(np.abs(got - autoregressive_distribution(sc))) > 1e-3


def test_acceptance_without_min_is_rejected_as_not_a_probability() -> None:
    # p/q without the min is not a probability; the enumerator refuses it (with signed weights it would even
    # cancel out exactly, and a real sampler's `u < a` clamps it, so it is not a useful broken variant).
    with pytest.raises(AssertionError, match="not a probability"):
        emitted_distribution(SCENARIOS[0], 2, _accept_without_min, residual_distribution)


# ----------------------------------------------------------------------------------------------------
# Empirical test of the real verify_stochastic path
# ----------------------------------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution: the regularised upper incomplete gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_prefactor = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:  # power series for the lower part P(a, z)
        term = total = 1.0 / a
        n = 1
        while abs(term) > 1e-17 * abs(total):
            term *= z / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # continued fraction for Q(a, z), evaluated with the modified Lentz method
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h * math.exp(log_prefactor)


def test_chi2_sf_reference_values() -> None:
    for x in (0.1, 1.0, 5.0, 30.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-12)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(37.65248413348277, 25) == pytest.approx(0.05, rel=1e-6)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    expected = counts.sum() * probs
    assert expected.min() >= 5.0, "chi-square approximation needs >= 5 expected per cell"
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, probs.size - 1)


VE = 5  # vocab of the empirical test
KE = 3  # draft length of the empirical test
TRIALS = 20_000
ALPHA = 1e-3


def _positional_model() -> tuple[np.ndarray, list[SparseDist]]:
    """Target and draft distributions that depend only on the position, so the truth is a product law."""
    rng = np.random.default_rng(1234)
    p = rng.dirichlet(np.full(VE, 3.0), size=LENGTH + KE)
    q = [truncate(rng.dirichlet(np.full(VE, 1.0)), 3) for _ in range(LENGTH + KE)]
    return p, q


def _generate(
    verify: Callable[[np.ndarray, list[int], list[SparseDist | None], np.random.Generator], VerifyOutcome],
    seed: int,
) -> tuple[np.ndarray, list[VerifyOutcome]]:
    p, q = _positional_model()
    draft_rng, verify_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    seqs = np.zeros((TRIALS, LENGTH), dtype=np.int64)
    first_rounds = []
    for n in range(TRIALS):
        seq: list[int] = []
        while len(seq) < LENGTH:
            s = len(seq)
            drafts = [sample(q[s + i], draft_rng) for i in range(KE)]
            outcome = verify(p[s : s + KE + 1], drafts, list(q[s : s + KE]), verify_rng)
            if s == 0:
                first_rounds.append(outcome)
            seq += [*drafts[: outcome.n_accepted], outcome.next_token]
        seqs[n] = seq[:LENGTH]
    return seqs, first_rounds


def test_verify_stochastic_matches_target_empirically() -> None:
    p, q = _positional_model()
    seqs, first_rounds = _generate(verify_stochastic, seed=2024)
    first = np.bincount(seqs[:, 0], minlength=VE)
    assert chi2_pvalue(first, p[0]) > ALPHA
    pair = np.bincount(seqs[:, 0] * VE + seqs[:, 1], minlength=VE * VE)
    assert chi2_pvalue(pair, np.outer(p[0], p[1])) > ALPHA
    assert chi2_pvalue(np.bincount(seqs[:, 2], minlength=VE), p[2]) > ALPHA
    # second token of the first round, given the first draft was accepted, is again distributed as p_1
    accepted = [o for o in first_rounds if o.n_accepted >= 1]
    second = np.bincount(seqs[[i for i, o in enumerate(first_rounds) if o.n_accepted >= 1], 1], minlength=VE)
    assert chi2_pvalue(second, p[1]) > ALPHA
    # the first draft is accepted with probability sum_t min(p_0(t), q_1(t))
    rate = sum(min(p[0][t], q[0].prob_of(t)) for t in range(VE))
    z = (len(accepted) - TRIALS * rate) / math.sqrt(TRIALS * rate * (1 - rate))
    assert abs(z) < 4.0
    assert 0.2 < rate < 0.9  # the draft is neither useless nor perfect, so both branches are exercised


def test_verify_stochastic_on_logits_rows_matches_target_empirically() -> None:
    """The path the target takes: WarpedRows over float32 logits with plain temperature, so acceptances are settled
    from bounds and the token after a rejection comes from the row's weights (`sample_residual`). The emitted
    tokens must follow the target's warped distributions, as with dense rows."""
    p, _ = _positional_model()
    params = SamplingParams(temperature=0.7)
    logits = (np.log(p) * params.temperature).astype(np.float32)
    target = np.stack([warp(row, params) for row in logits])  # p after the float32 round trip

    def verify(rows: np.ndarray, drafts: list[int], dists: list[SparseDist | None], rng: np.random.Generator):
        s = int(np.flatnonzero((p == rows[0]).all(axis=1))[0])  # the position these rows belong to
        return verify_stochastic(WarpedRows(logits[s : s + len(drafts) + 1], params), drafts, dists, rng)

    seqs, _ = _generate(verify, seed=77)
    assert chi2_pvalue(np.bincount(seqs[:, 0], minlength=VE), target[0]) > ALPHA
    pair = np.bincount(seqs[:, 0] * VE + seqs[:, 1], minlength=VE * VE)
    assert chi2_pvalue(pair, np.outer(target[0], target[1])) > ALPHA
    assert chi2_pvalue(np.bincount(seqs[:, 2], minlength=VE), target[2]) > ALPHA


def test_empirical_check_has_teeth() -> None:
    """Accepting every draft (emitting q, not p) must be caught by the same chi-square check."""

    def accept_all(
        target_probs: np.ndarray, drafts: list[int], dists: list[SparseDist | None], rng: np.random.Generator
    ) -> VerifyOutcome:
        return VerifyOutcome(n_accepted=len(drafts), next_token=sample(target_probs[-1], rng))

    p, _ = _positional_model()
    seqs, _ = _generate(accept_all, seed=2024)
    assert chi2_pvalue(np.bincount(seqs[:, 0], minlength=VE), p[0]) < 1e-9


# ----------------------------------------------------------------------------------------------------
# verify_greedy / verify_stochastic behaviour
# ----------------------------------------------------------------------------------------------------


def test_verify_greedy_crafted() -> None:
    assert verify_greedy([3, 1, 4, 1], [3, 1, 5]) == VerifyOutcome(n_accepted=2, next_token=4)
    assert verify_greedy([3, 1, 4, 1], [3, 1, 4]) == VerifyOutcome(n_accepted=3, next_token=1)  # bonus
    assert verify_greedy([3, 1, 4, 1], [0, 1, 4]) == VerifyOutcome(n_accepted=0, next_token=3)
    assert verify_greedy([3, 1, 4, 1], [3, 9, 4]) == VerifyOutcome(n_accepted=1, next_token=1)
    assert verify_greedy([7], []) == VerifyOutcome(n_accepted=0, next_token=7)
    assert verify_greedy(np.array([2, 2]), np.array([2])) == VerifyOutcome(n_accepted=1, next_token=2)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_verify_stochastic_with_one_hot_target_is_greedy() -> None:
    rng = np.random.default_rng(5)
    vocab = 6
    for trial in range(300):
        k = int(rng.integers(0, 5))
        argmax = rng.integers(0, vocab, size=k + 1)
        logits = rng.normal(size=(k + 1, vocab))
        logits[np.arange(k + 1), argmax] = 10.0
        target = np.stack([warp(row, SamplingParams(temperature=0.0)) for row in logits])
        # drafts match the argmax with probability ~1/2 at each position, so all n_accepted values occur
        drafts = [int(a) if rng.random() < 0.5 else int(rng.integers(0, vocab)) for a in argmax[:k]]
        dists: list[SparseDist | None] = [None] * k
        if trial % 2 == 0:
            sparse = []
            for d in drafts:
                raw = rng.dirichlet(np.ones(vocab))
                raw[d] += 0.5
                sparse.append(truncate(raw / raw.sum(), 3))
            # a sampled draft can only propose tokens inside its support
            drafts = [d if q.prob_of(d) > 0 else int(q.token_ids[0]) for d, q in zip(drafts, sparse, strict=True)]
            dists = list(sparse)
        expected = verify_greedy([int(np.argmax(row)) for row in target], drafts)
        assert verify_stochastic(target, drafts, dists, rng) == expected


def _random_round(rng: np.random.Generator, k: int) -> tuple[np.ndarray, list[int], list[SparseDist | None]]:
    target = rng.dirichlet(np.ones(VE), size=k + 1)
    dists: list[SparseDist | None] = [truncate(rng.dirichlet(np.ones(VE)), 3) for _ in range(k)]
    drafts = [sample(d, rng) for d in dists if d is not None]
    return target, drafts, dists


def test_verify_stochastic_is_reproducible_with_seed() -> None:
    rounds = [_random_round(np.random.default_rng([9, i]), k=3) for i in range(200)]

    def run(seed: int) -> list[VerifyOutcome]:
        rng = np.random.default_rng(seed)
        return [verify_stochastic(t, d, q, rng) for t, d, q in rounds]

    first = run(42)
    assert run(42) == first
    assert run(43) != first
    assert len({o.n_accepted for o in first}) == 4  # 0..3 all occur


def test_verify_stochastic_draw_count() -> None:
    """One uniform per examined draft plus one for the final token: callers can rely on the RNG stream."""
    for i in range(100):
        target, drafts, dists = _random_round(np.random.default_rng([10, i]), k=3)
        rng = np.random.default_rng(i)
        outcome = verify_stochastic(target, drafts, dists, rng)
        draws = min(outcome.n_accepted + 1, 3) + 1
        reference = np.random.default_rng(i)
        reference.random(draws)
        assert rng.random() == reference.random()


def test_verify_stochastic_k0_samples_from_p0() -> None:
    p0 = np.array([[0.1, 0.0, 0.6, 0.3]])
    rng, reference = np.random.default_rng(77), np.random.default_rng(77)
    outcomes = [verify_stochastic(p0, [], [], rng) for _ in range(4000)]
    assert all(o.n_accepted == 0 for o in outcomes)
    tokens = [o.next_token for o in outcomes]
    assert tokens == [sample(p0[0], reference) for _ in range(4000)]
    counts = np.bincount(tokens, minlength=4)
    assert counts[1] == 0
    assert chi2_pvalue(counts[[0, 2, 3]], p0[0, [0, 2, 3]]) > ALPHA
    one_hot = warp(np.array([0.0, 2.0, 1.0]), SamplingParams(temperature=0.0))[None, :]
    assert verify_stochastic(one_hot, [], [], rng) == VerifyOutcome(n_accepted=0, next_token=1)


def test_verify_stochastic_validates_shapes() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        verify_stochastic(np.full((2, 3), 1 / 3), [0, 1], [None, None], rng)
    with pytest.raises(ValueError):
        verify_stochastic(np.full((2, 3), 1 / 3), [0], [], rng)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.4])
def test_residual_from_weights_draws_what_the_residual_distribution_draws(temperature: float) -> None:
    """`WarpedRows.sample_residual` (the token after a rejection, from the row's weights) against
    `sample(residual_distribution(warp(row), q, token))`, uniform by uniform: for a deterministic draft (q None) and
    for a model draft's q, the same token except within rounding of a CDF boundary, never the rejected n-gram token,
    and without warping the row."""
    rng = np.random.default_rng(int(temperature * 100))
    params = SamplingParams(temperature=temperature)
    differed = 0
    for trial in range(6):
        logits = (rng.standard_normal(49_152) * 3).astype(np.float32)
        logits[rng.integers(0, logits.size, 40)] += 12.0
        p = warp(logits, params)
        token = int(np.argmax(p)) if trial % 2 else int(rng.choice(p.size, p=p))
        q = None
        if trial >= 3:  # a model draft whose distribution holds the token and overlaps p's head
            q = draft_distribution(logits + rng.normal(0.0, 0.5, logits.size).astype(np.float32), params, 32)
            token = int(q.token_ids[0])
        reference_dist = residual_distribution(p, q, token)
        for u in [0.0, float(np.nextafter(1.0, 0.0)), *rng.random(400)]:
            rows = WarpedRows(logits[None, :], params)
            fast = rows.sample_residual(0, token, q, _FixedUniform(u))  # type: ignore[arg-type]
            reference = sample(reference_dist, _FixedUniform(u))  # type: ignore[arg-type]
            assert rows.warped == 0
            assert reference_dist[fast] > 0.0
            if fast != reference:
                differed += 1
                # Model drafts round the changed weights to float32 (~6e-8 relative): the boundary can move by that.
                assert _boundary_distance(reference_dist, u) < (1e-12 if q is None else 1e-6), (trial, u)
    assert differed <= 2


def test_residual_from_weights_falls_back_like_residual_distribution() -> None:
    """Other settings and warped rows take the exact path; a q equal to p (no residual mass) draws from p, as
    residual_distribution returns it; one uniform per draw."""
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((2, 3000)) * 2).astype(np.float32)
    for params in (SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=0.9, top_p=0.8)):
        p = warp(logits[0], params)
        token = int(np.argmax(p))
        for u in rng.random(50):
            got = WarpedRows(logits, params).sample_residual(0, token, None, _FixedUniform(u))  # type: ignore[arg-type]
            assert got == sample(residual_distribution(p, None, token), _FixedUniform(u))  # type: ignore[arg-type]
    params = SamplingParams(temperature=1.0)
    one_hot = np.full(3000, -1e4, dtype=np.float32)
    one_hot[7] = 0.0  # all the mass on token 7 (the others underflow to 0)
    q = SparseDist(np.array([7]), np.array([1.0]))
    rows = WarpedRows(one_hot[None, :], params)
    assert rows.sample_residual(0, 7, q, _FixedUniform(0.3)) == 7  # type: ignore[arg-type]
    assert rows.sample_residual(0, 7, None, _FixedUniform(0.3)) == 7  # type: ignore[arg-type]
    draws, reference = np.random.default_rng(3), np.random.default_rng(3)
    WarpedRows(logits, params).sample_residual(1, 5, None, draws)
    reference.random()
    assert draws.random() == reference.random()


def test_residual_from_weights_matches_frequencies() -> None:
    """Over 40,000 draws after rejecting a model draft's token, each token's frequency is within 5 standard errors of
    norm(max(0, p - q))."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * 1500, dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    q = SparseDist(np.array([0, 1, 3]), np.array([0.6, 0.1, 0.3]))
    r = residual_distribution(warp(logits, params), q, 0)
    rng = np.random.default_rng(17)
    counts = np.zeros(r.size)
    n = 40_000
    rows = WarpedRows(logits[None, :], params)
    for _ in range(n):
        counts[rows.sample_residual(0, 0, q, rng)] += 1
    sigma = np.sqrt(r * (1 - r) / n)
    assert np.all(np.abs(counts / n - r) <= 5 * sigma + 1e-12)
    assert counts[0] == 0 and counts[3] == 0  # q covers p there: no residual mass


def test_lazily_warped_rows_give_the_same_outcome_and_skip_unread_rows() -> None:
    """WarpedRows (what the target passes) must verify exactly as the dense (k+1, V) array, seed for seed, while
    warping only the rows read: up to the first rejection, plus the row the next token comes from."""
    rng = np.random.default_rng(21)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    read_less = 0
    for trial in range(300):
        k = int(rng.integers(0, 8))
        logits = rng.normal(0.0, 2.0, size=(k + 1, 64)).astype(np.float32)
        drafts = [int(t) for t in rng.integers(0, 64, size=k)]
        dense = np.stack([warp(row, params) for row in logits])
        lazy = WarpedRows(logits, params)
        a = verify_stochastic(dense, drafts, [None] * k, np.random.default_rng(trial))
        b = verify_stochastic(lazy, drafts, [None] * k, np.random.default_rng(trial))
        assert a == b
        assert lazy.warped == a.n_accepted + 1
        read_less += lazy.warped < k + 1
    assert read_less > 100  # most random drafts fail early: the rows after the rejection were never warped


def test_bounded_acceptance_agrees_with_the_warped_row() -> None:
    """WarpedRows.accepts answers exactly what the warped row answers, or None; with u drawn near the acceptance
    probability, on either side of it to float precision, it must defer rather than guess."""
    rng = np.random.default_rng(31)
    decided = deferred = 0
    for trial in range(400):
        vocab = int(rng.choice([64, 4096, 49152]))
        t = float(rng.choice([0.2, 0.7, 1.0, 1.6]))
        logits = rng.normal(0.0, float(rng.choice([1.0, 3.0, 8.0])), size=(1, vocab)).astype(np.float32)
        params = SamplingParams(temperature=t)
        p = warp(logits[0], params)
        token = int(rng.choice(vocab, p=p)) if trial % 3 else int(rng.integers(vocab))
        q = None
        if trial % 2:  # a sampled draft: q from another distribution that holds the token
            other = warp(logits[0] + rng.normal(0.0, 1.0, size=vocab).astype(np.float32), params)
            q = draft_distribution(np.log(np.maximum(other, 1e-300)), SamplingParams(), 32)
            if q.prob_of(token) == 0.0:
                q = SparseDist(np.array([token]), np.array([1.0]))
        a = acceptance_probability(p, q, token)
        near_a = (a, np.nextafter(a, 0.0), np.nextafter(a, 1.0), a * (1 - 1e-7), a * (1 + 1e-7))
        for n, u in enumerate((rng.random(), *near_a)):
            u = float(min(max(u, 0.0), np.nextafter(1.0, 0.0)))
            answer = WarpedRows(logits, params).accepts(0, token, q, u)
            if answer is not None:
                assert answer == (u < a), (trial, u, a)
            if n == 0:
                decided += answer is not None
            elif 0.0 < a < 1.0:
                deferred += answer is None
    assert decided >= 396  # the bounds settle almost every random u...
    assert deferred >= 1000  # ...and defer the ones at the acceptance probability itself


def test_bounded_acceptance_only_for_plain_temperature_and_unread_rows() -> None:
    logits = np.random.default_rng(2).normal(size=(2, 100)).astype(np.float32)
    for params in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.9), SamplingParams(temperature=0)):
        assert WarpedRows(logits, params).accepts(0, 3, None, 0.5) is None
    rows = WarpedRows(logits, SamplingParams(temperature=0.7))
    assert rows.accepts(0, int(np.argmax(logits[0])), None, 0.0) is True
    assert rows.accepts(0, int(np.argmin(logits[0])), None, 0.999) is False
    rows[1]  # warped already: the exact test is as cheap
    assert rows.accepts(1, 3, None, 0.5) is None
    assert WarpedRows(logits.astype(np.float64), SamplingParams()).accepts(0, 3, None, 0.5) is None
    assert rows.warped == 1


def test_verify_stochastic_with_bounds_matches_dense_rows_seed_for_seed() -> None:
    """Plain temperature sampling on a 49k vocabulary (the bounded path): the same outcome as the dense array, seed
    for seed, for deterministic and sampled drafts, and accepted drafts leave their rows unwarped."""
    rng = np.random.default_rng(41)
    params = SamplingParams(temperature=0.7)
    unwarped = 0
    for trial in range(60):
        k = int(rng.integers(1, 6))
        logits = rng.normal(0.0, 3.0, size=(k + 1, 49152)).astype(np.float32)
        dense = np.stack([warp(row, params) for row in logits])
        # Drafts that the target likes, so that many are accepted.
        drafts = [int(rng.choice(49152, p=dense[i])) for i in range(k)]
        dists = [None] * k
        if trial % 2:
            dists = [draft_distribution(logits[i] + np.float32(0.3), params, 32) for i in range(k)]
            drafts = [int(d.token_ids[0]) for d in dists]
        lazy = WarpedRows(logits, params)
        a = verify_stochastic(dense, drafts, dists, np.random.default_rng(trial))
        b = verify_stochastic(lazy, drafts, dists, np.random.default_rng(trial))
        assert a == b
        unwarped += k + 1 - lazy.warped
    assert unwarped > 60


def test_argmax_rows_read_only_up_to_the_first_mismatch() -> None:
    """verify_greedy over lazily argmaxed rows: the same outcome as over all argmaxes, and the rows after the first
    mismatch are never read (a long rejected draft costs no scan of its tail)."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((9, 50)).astype(np.float32)
    argmax = [int(np.argmax(r)) for r in rows]

    class Recording(list):
        """Rows that remember which indexes were read."""

        def __init__(self, items) -> None:
            super().__init__(items)
            self.read: set[int] = set()

        def __getitem__(self, i):
            self.read.add(i)
            return super().__getitem__(i)

    for mismatch in range(9):
        drafts = [*argmax[:mismatch], *[(a + 1) % 50 for a in argmax[mismatch:8]]]
        recording = Recording(rows)
        assert verify_greedy(ArgmaxRows(recording), drafts) == verify_greedy(argmax, drafts)
        assert sorted(recording.read) == list(range(min(mismatch, 8) + 1))
