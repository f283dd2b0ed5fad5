"""Sampling distributions and draws: the knobs (SamplingParams), the exact sparse q a draft sends (SparseDist),
the warp to the final distribution (temperature, top-k, top-p), truncation, and drawing one token.

Speculative decoding is lossless only if p and q are the *final* distributions that tokens are actually drawn from,
i.e. after temperature, top-k and top-p: `warp` produces exactly those, on both sides, and the draft must send the
exact q it sampled from (see `truncate` and `draft_distribution`). The acceptance and rejection math of a
verification round that consumes them lives in `tandem.acceptance`.
Greedy decoding (temperature 0) is the special case where the distribution is one-hot at the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy: dividing by them would overflow and the result is argmax."""

TOP_P_TOLERANCE = 1e-12
"""Slack on the top-p cumulative threshold, so 0.4 + 0.3 counts as reaching top_p=0.7 despite rounding."""

_TOP_P_FIRST_CANDIDATES = 1024
"""Initial candidate count for top-p over a full vocab; usually enough, so we avoid sorting 262k entries."""


@dataclass(frozen=True)
class SamplingParams:
    """User-facing sampling knobs; the same warp must be applied on the draft and target side."""

    temperature: float = 1.0  # 0.0 => greedy
    top_k: int = 0  # 0 => disabled
    top_p: float = 1.0  # 1.0 => disabled
    seed: int | None = None

    def __post_init__(self) -> None:
        if math.isnan(self.temperature):
            raise ValueError("temperature must not be NaN")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Greedy when the temperature is (numerically) zero; the distribution is then one-hot at argmax."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SparseDist:
    """A distribution known exactly on a small support (what a draft sends over gRPC)."""

    token_ids: np.ndarray  # int64, shape (n,)
    probs: np.ndarray  # float64, shape (n,), sums to 1

    def __post_init__(self) -> None:
        ids = np.array(self.token_ids, dtype=np.int64).reshape(-1)
        probs = np.array(self.probs, dtype=np.float64).reshape(-1)
        if ids.shape != probs.shape or ids.size == 0:
            raise ValueError(f"token_ids and probs must be non-empty and equally long, got {ids.shape}, {probs.shape}")
        if np.any(ids < 0) or np.unique(ids).size != ids.size:
            raise ValueError("token_ids must be distinct and non-negative")
        if not np.all(np.isfinite(probs)) or np.any(probs < 0.0):
            raise ValueError("probs must be finite and non-negative")
        if abs(float(probs.sum()) - 1.0) > 1e-6:
            raise ValueError(f"probs must sum to 1, got {float(probs.sum())!r}")
        self._install(ids, probs)

    def _install(self, ids: np.ndarray, probs: np.ndarray) -> None:
        """Frozen dataclass: the arrays are made read-only and installed once, so callers cannot mutate q afterwards."""
        ids.flags.writeable = False
        probs.flags.writeable = False
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "probs", probs)

    @classmethod
    def exact(cls, token_ids: np.ndarray, probs: np.ndarray) -> SparseDist:
        """A SparseDist from arrays that already hold its invariants (int64 distinct ids, float64 probs summing to 1),
        without the checks: they cost ~20 us at 256 tokens, and a sampled draft token builds one on each side."""
        dist = object.__new__(cls)
        dist._install(token_ids, probs)
        return dist

    def prob_of(self, token: int) -> float:
        """q(token); zero outside the support (the support is small, so a linear scan is cheapest)."""
        hits = np.flatnonzero(self.token_ids == token)
        return float(self.probs[hits[0]]) if hits.size else 0.0

    def dense(self, vocab_size: int) -> np.ndarray:
        """The same distribution as a full-vocab vector, for code that needs p - q elementwise."""
        if int(self.token_ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(self.token_ids.max())} outside vocab of size {vocab_size}")
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.token_ids] = self.probs
        return out


def _as_logits(logits: np.ndarray) -> tuple[np.ndarray, float]:
    """(the logits, float32 or float64 and not copied, their max), after checking they can be sampled."""
    x = np.asarray(logits)
    if x.dtype != np.float32 and x.dtype != np.float64:
        x = x.astype(np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    top = float(x.max())  # NaN propagates into the max and +inf is the max: one pass checks both
    # math on the Python float: numpy's isposinf on a scalar costs ~3 us, and this runs for every sampled token.
    if math.isnan(top) or top == math.inf:
        raise ValueError("logits must not contain NaN or +inf")
    if top == -math.inf:
        raise ValueError("all logits are -inf: no token can be sampled")
    return x, top


def _ranked(ids: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Order positions by descending prob, ties by ascending token id, so truncation is deterministic."""
    return np.lexsort((ids, -probs))


def _tie_closed_top(values: np.ndarray, n: int) -> np.ndarray:
    """Positions of the n largest values plus anything tied with the n-th; O(V) via argpartition."""
    if n >= values.size:
        return np.arange(values.size)
    kth = values[np.argpartition(values, values.size - n)[values.size - n]]
    return np.flatnonzero(values >= kth)


_TOP_WINDOW = 8.0
"""First width below the largest logit that `_top_candidates` searches; on SmolLM2 the 256th largest logit lies 4.5-12.4
below the largest (median 8.3, 64 sampled steps), so one to three widths settle it."""


def _top_candidates(x: np.ndarray, top: float, n: int) -> np.ndarray:
    """`_tie_closed_top(x, n)` (ascending positions) from the values within a window below the largest, `top`.

    Once the window holds at least n values, the n-th largest value lies inside it, and so does everything tied with
    or above it: selecting among the window gives the same set. Listing a window costs ~13 us at 49k float32 logits
    (2-core CPU), against ~54 us for an argpartition of the whole row. The window widens by a third at a time (by
    doubling, it often took in 10-20k logits, whose positions cost more to list than the counts saved), and after a few
    tries the whole row is taken.
    """
    if n >= x.size:
        return np.arange(x.size)
    width = _TOP_WINDOW
    for _ in range(8):
        window = np.flatnonzero(x >= top - width)  # counting first and listing after costs one more pass
        if window.size >= n:
            return window[_tie_closed_top(x[window], n)]
        width *= 1.35
    return _tie_closed_top(x, n)


def _top_p_keep(ids: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids of the smallest highest-prob prefix whose mass reaches top_p (never empty)."""
    target = top_p - TOP_P_TOLERANCE
    n_cand = min(_TOP_P_FIRST_CANDIDATES, probs.size)
    while True:
        # The tie-closed top-n set is exactly a prefix of the full ranking, so if it already reaches top_p
        # the answer lies inside it and the rest of the vocab never needs sorting.
        pos = _tie_closed_top(probs, n_cand)
        order = pos[_ranked(ids[pos], probs[pos])]
        cum = np.cumsum(probs[order])
        if cum[-1] >= target or order.size == probs.size:
            m = min(int(np.searchsorted(cum, target, side="left")) + 1, order.size)
            return ids[order[:m]]
        n_cand *= 4


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Final sampling distribution over the full vocab (float64, sums to 1, zeros outside the support).

    Order: greedy -> one-hot argmax (lowest id on ties); else temperature scale, then top-k (keep the k
    largest; ties at the boundary are kept), then top-p on the renormalised top-k distribution (smallest
    set of highest-prob tokens whose cumulative prob >= top_p, always >= 1 token), then renormalise. Both
    sides of speculative decoding must use this so that p and q are the distributions tokens are drawn from.
    """
    x, top = _as_logits(logits)
    vocab = x.size
    if params.greedy:
        out = np.zeros(vocab, dtype=np.float64)
        out[int(np.argmax(x))] = 1.0
        return out
    if _plain_temperature(params, vocab):
        return _temperature_softmax(x, top, params.temperature)

    # Shifting by the max before dividing leaves softmax(x / T) unchanged and cannot overflow for small T. The
    # subtraction casts to float64 first (exact for float32 logits), so the result is as if x were float64.
    scaled = np.subtract(x, top, dtype=np.float64)
    # Multiplying by reciprocals instead of dividing (here and below): float64 division is several times slower than
    # multiplication (a whole warp of 49k logits: 141 -> 119 us on the 2-core CPU), and the results differ by an ulp.
    scaled *= 1.0 / params.temperature
    if 0 < params.top_k < vocab:
        ids = _tie_closed_top(scaled, params.top_k)
        z = scaled[ids]
    else:
        ids = np.arange(vocab)
        z = scaled
    probs = np.exp(z - z.max())
    probs *= 1.0 / probs.sum()

    out = np.zeros(vocab, dtype=np.float64)
    if params.top_p < 1.0:
        # Underflowed tokens can never be inside the nucleus; dropping them keeps the candidate sets small.
        pos = np.flatnonzero(probs > 0.0)
        keep = _top_p_keep(ids[pos], probs[pos], params.top_p)
        out[keep] = np.exp(scaled[keep] - scaled[keep].max())
    else:
        out[ids] = probs
    out *= 1.0 / out.sum()
    return out


def _plain_temperature(params: SamplingParams, vocab: int) -> bool:
    """Sampled, with no top-p and no top-k short of the vocabulary: the distribution is softmax(x / T) over it all."""
    return not params.greedy and (params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0


def _temperature_softmax(x: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """softmax(x / T) over the whole vocabulary: plain temperature sampling, the hot path (one call per sampled token).

    The exponentials are taken in float32, as llama.cpp's own sampler takes them: numpy vectorises float32 `exp` with
    AVX2, float64 `exp` only with AVX-512: on the 2-core AVX2 CPU, with a build running beside it, a 49k-token softmax
    took 821 us in float64 and 324 us in float32, against target steps of 15-20 ms. The cost is precision:
    probabilities carry a relative error of about 1e-6, and a token whose probability is below float32's range
    (~1e-38 of the most likely one) gets 0 and is never drawn.
    The result is float64 and normalised in float64, so the acceptance and residual math after it is unchanged; both
    sides of speculative decoding and target-only decoding all draw from this same distribution.
    """
    out = _temperature_weights(x, top, temperature).astype(np.float64)
    out *= 1.0 / out.sum()
    return out


def _temperature_weights(x: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """exp((x - top) / T) in float32: `_temperature_softmax` before normalising (the top token weighs 1)."""
    # z <= 0 with the most likely token at 0, so exp cannot overflow; float64 logits are shifted before the cast.
    z = np.subtract(x, np.float32(top)) if x.dtype == np.float32 else np.subtract(x, top).astype(np.float32)
    z *= np.float32(1.0 / temperature)
    np.exp(z, out=z)
    return z


def truncate(probs: np.ndarray, max_support: int) -> SparseDist:
    """Keep the max_support most probable tokens of a dense distribution and renormalise.

    The draft samples from THIS (not from the dense distribution) so that the q it sends is exact and small.
    Zero-probability tokens are never included; ties at the cut keep the lowest token ids.
    """
    if max_support < 1:
        raise ValueError(f"max_support must be >= 1, got {max_support}")
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"probs must be 1-D, got shape {p.shape}")
    nonzero = np.flatnonzero(p > 0.0)
    if nonzero.size == 0:
        raise ValueError("distribution has no positive mass")
    cand = nonzero[_tie_closed_top(p[nonzero], max_support)]
    keep = cand[_ranked(cand, p[cand])][:max_support]
    kept = p[keep]
    return SparseDist(token_ids=keep.astype(np.int64), probs=kept / kept.sum())


def draft_distribution(logits: np.ndarray, params: SamplingParams, max_support: int) -> SparseDist:
    """What a draft samples from and sends: `truncate(warp(logits, params), max_support)`, from the largest logits.

    Temperature and top-k rank tokens as their logits do, and truncation renormalises over the tokens it keeps, so
    the whole vocabulary's normaliser cancels: the max_support largest logits are all it needs. On the 2-core CPU,
    with a build running beside it, that took 0.24 ms a draft token at 49k tokens, against 1.67 ms for warping the
    whole vocabulary and then truncating it. Top-p, and a top-k smaller than max_support, take that full path (the
    nucleus needs the whole vocabulary's mass).

    The probabilities are computed in float64 over the kept tokens, so they differ from the full path's (float32
    exponentials, see `_temperature_softmax`) by rounding, ~1e-7 relative. Lossless acceptance needs only that the
    draft samples from exactly the distribution it sends, which holds for either.
    """
    if max_support < 1:
        raise ValueError(f"max_support must be >= 1, got {max_support}")
    if params.greedy or params.top_p < 1.0 or 0 < params.top_k < max_support or max_support >= np.size(logits):
        return truncate(warp(logits, params), max_support)
    x, top = _as_logits(logits)
    # Tie-closed candidates, then the ranking truncate uses (descending probability, ties by lowest id).
    cand = _top_candidates(x, top, max_support)
    z = np.subtract(x[cand], top, dtype=np.float64)
    keep = _ranked(cand, z)[:max_support]
    ids, z = cand[keep], z[keep]
    probs = np.exp(z * (1.0 / params.temperature))
    probs = probs[probs > 0.0]  # underflow (a token ~745 * T below the top): never sampled, not sent
    # Distinct ids (positions), finite non-negative probs with the top one at 1: valid by construction.
    return SparseDist.exact(ids[: probs.size].astype(np.int64), probs / probs.sum())


def sample(probs: np.ndarray | SparseDist, rng: np.random.Generator) -> int:
    """Draw one token by inverting the CDF with exactly one uniform, so RNG consumption is predictable."""
    if isinstance(probs, SparseDist):
        return int(probs.token_ids[_inverse_cdf(probs.probs, rng)])
    return _inverse_cdf(np.asarray(probs, dtype=np.float64), rng)


def sample_logits(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """`sample(warp(logits, params), rng)`, the draw of a target-only token or a bonus token, without the warp's
    normalised float64 copy where it is not needed.

    Plain temperature sampling inverts the CDF of the float32 weights `_temperature_softmax` normalises, summed in
    float64: the same distribution, divided by its total at the draw instead of token by token, so a token differs
    from the warped draw's only where u falls within rounding (~1e-16) of a CDF boundary. One uniform either way.
    On the 2-core CPU at 49k tokens: 130 us against 160-190 us a token (the exponentials are ~65 us of it). Most
    draws need only the tokens near the top (`_near_inverse_cdf`): right after a forward pass, with the caches cold,
    that took ~310 us against ~530 us for the whole-vocabulary weights (SmolLM2, T=0.7, 2-core CPU).
    Greedy: the argmax, which draws nothing (as `warp` one-hot and then `sample` would not need to).
    """
    x, top = _as_logits(logits)
    if params.greedy:
        return int(np.argmax(x))
    if not _plain_temperature(params, x.size):
        return sample(warp(x, params), rng)
    u = rng.random()
    token = _near_inverse_cdf(x, top, params.temperature, u)
    if token is not None:
        return token
    return _inverse_cdf(_temperature_weights(x, top, params.temperature), rng, u)


_FAR_EXPONENT = 20.0
"""`acceptance.WarpedRows.accepts` and `_near_inverse_cdf` sum only tokens whose scaled logit is within this of the
top; each of the others weighs at most e^-20 ~ 2e-9 of the top token, so at 49k tokens together at most 1e-4 of the
normaliser."""

_BOUND_SLACK = 1e-6
"""Relative slack on those bounds: float32 exponentials of one value may differ by a few ulps between numpy's vector
loop and a short array (~3e-7 at most), and the float64 sums by far less."""

_CDF_BLOCK = 256  # inverse CDF in two levels: block sums, then one block (a full cumsum cost ~0.12 ms at 49k)


def _near_inverse_cdf(x: np.ndarray, top: float, temperature: float, u: float) -> int | None:
    """The token `_inverse_cdf(_temperature_weights(x, top, temperature), rng, u)` returns, found from the tokens
    within `_FAR_EXPONENT` of the top alone where that settles it; None where it does not (the caller inverts the
    whole CDF with the same u).

    Each far token weighs at most e^-20 of the top one, so the far tokens before any index, and all of them, add
    at most their count times that to the CDF there and to its total. The pick is the first near token whose near-only
    CDF exceeds u times the largest possible total, provided the CDF just before it (the near tokens before it plus
    every far token before it at their largest) stays at or below u times the smallest possible total: then the
    whole CDF crosses u times its total exactly there. A far token is never returned (its draws, at most ~1e-4 of the
    mass, go to the caller), nor is anything where more than an eighth of the vocabulary is near (a flat row: the
    whole CDF then costs about the same). The near weights are the same float32 values, summed in float64 in
    another order, so the token differs from the whole CDF's only where u lies within rounding of a boundary.
    """
    close = x >= top - _FAR_EXPONENT * temperature * (1.0 + _BOUND_SLACK)
    n_near = int(np.count_nonzero(close))
    if 8 * n_near > x.size:
        return None
    near = np.flatnonzero(close)
    cum = np.cumsum(_temperature_weights(x[near], top, temperature), dtype=np.float64)
    far_weight = math.exp(-_FAR_EXPONENT) * (1.0 + _BOUND_SLACK)
    s_near = float(cum[-1])
    rank = int(np.searchsorted(cum, u * (s_near + (x.size - n_near) * far_weight), side="right"))
    if rank >= n_near:
        return None  # beyond the near tokens' mass at its largest total: possibly a far token
    token = int(near[rank])
    below = (float(cum[rank - 1]) if rank else 0.0) + (token - rank) * far_weight
    return token if below <= u * s_near else None


def _inverse_cdf(p: np.ndarray, rng: np.random.Generator, u: float | None = None) -> int:
    """Invert the CDF of weights `p` (float64, or float32 summed in float64; they need not sum to 1) at a uniform:
    `u` where the caller drew it already, else one drawn from `rng`."""
    if u is None:
        u = rng.random()
    if p.size <= 4 * _CDF_BLOCK:
        return _inverse_cdf_flat(p, u)
    starts = np.arange(0, p.size, _CDF_BLOCK)
    cum = np.cumsum(np.add.reduceat(p, starts, dtype=np.float64))
    total = float(cum[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no positive mass")
    u *= total
    # side="right" skips blocks with no mass (their cum equals the previous one), as it skips zero entries below.
    b = min(int(np.searchsorted(cum, u, side="right")), starts.size - 1)
    while b > 0 and cum[b] == cum[b - 1]:  # u * total rounded up to total: the last block with mass
        b -= 1
    base = float(cum[b - 1]) if b else 0.0
    block = p[starts[b] : starts[b] + _CDF_BLOCK]
    return int(starts[b]) + _inverse_cdf_flat(block, (u - base) / float(cum[b] - base))


def _inverse_cdf_flat(p: np.ndarray, u: float) -> int:
    """Index of the entry whose CDF interval holds u * total (u in [0, 1)); never a zero-probability entry."""
    cum = np.cumsum(p, dtype=np.float64)
    total = float(cum[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no positive mass")
    # side="right" never lands on a zero-probability entry: its cum equals the previous one.
    idx = int(np.searchsorted(cum, u * total, side="right"))
    if idx >= p.size:  # u * total rounded up to total
        idx = int(np.flatnonzero(p > 0.0)[-1])
    return idx
