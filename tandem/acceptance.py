"""Lossless speculative acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

A cheap *draft* proposes k tokens d_1..d_k, each sampled from its own distribution q_i (or chosen
deterministically, e.g. greedy or n-gram lookup; q_i is then one-hot on d_i). The *target* scores the prefix
extended by the drafts in one pass and yields p_0..p_k, where p_i is the target distribution of the token that
follows prefix + d_1..d_i. One verification round then walks the drafts in order:

* **accepted**: d_i is kept with probability min(1, p_{i-1}(d_i) / q_i(d_i));
* **recovered**: on the first rejection, a replacement is drawn from norm(max(0, p_{i-1} - q_i)) (the
  *residual*) and the round stops; the remaining drafts are discarded;
* **bonus**: if all k drafts are accepted, one extra token is drawn from p_k for free.

Every round therefore emits between 1 and k + 1 tokens, and the emitted sequence has exactly the
distribution obtained by sampling the target autoregressively, whatever the draft does. That guarantee only
holds if p and q are the *final* distributions that tokens are actually drawn from, which `tandem.sampling`
produces (`warp` on both sides, `truncate` for the q a draft sends).
Greedy decoding (temperature 0) is the special case where p is one-hot at the target argmax (`verify_greedy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.sampling import (
    _BOUND_SLACK,
    _FAR_EXPONENT,
    SamplingParams,
    SparseDist,
    _as_logits,
    _inverse_cdf,
    _plain_temperature,
    _temperature_weights,
    sample,
    sample_logits,
    warp,
)

RESIDUAL_EPS = 1e-12
"""Residual mass at or below this is rounding noise (p == q up to float error); we then fall back to p."""


def acceptance_probability(p: np.ndarray, q: SparseDist | None, token: int) -> float:
    """min(1, p[token]/q(token)); q None means a deterministic draft (one-hot on token) => p[token]."""
    pt = float(p[token])
    if q is None:
        return min(1.0, max(0.0, pt))
    qt = q.prob_of(token)
    if qt <= 0.0:
        raise ValueError(f"draft token {token} has q=0, so it cannot have been sampled from q")
    return min(1.0, pt / qt)


def _support_in(q: SparseDist, vocab: int) -> np.ndarray:
    """q's token ids, checked against the target's vocabulary."""
    if int(q.token_ids.max()) >= vocab:
        raise ValueError("draft distribution has token ids outside the target vocab")
    return q.token_ids


def residual_distribution(p: np.ndarray, q: SparseDist | None, token: int) -> np.ndarray:
    """norm(max(0, p - q)): what to sample from after a rejection so the overall output is exactly p.

    For q None (one-hot on token) that is p with token zeroed, renormalised. If the residual has zero mass
    (p == q numerically), p is returned: with exact arithmetic a rejection is then impossible.
    """
    p = np.asarray(p, dtype=np.float64)
    r = p.copy()
    if q is None:
        r[token] = 0.0
    else:
        ids = _support_in(q, p.size)  # q is zero off its support, so only its support can change
        r[ids] = np.maximum(0.0, p[ids] - q.probs)
    mass = float(r.sum())
    if mass <= RESIDUAL_EPS:
        return p.copy()
    r *= 1.0 / mass
    return r


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of one verification round: the accepted drafts plus one recovered or bonus token."""

    n_accepted: int  # how many draft tokens were accepted (0..k)
    next_token: int  # the recovered (after reject) or bonus (all accepted) token


def verify_greedy(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> VerifyOutcome:
    """Greedy verification: accept while draft == target argmax; next_token = target_argmax[n_accepted].

    target_argmax[i] is the argmax of the target logits at position i (len k+1). Draws no random numbers,
    so greedy output is identical with and without speculation.
    """
    k = len(draft_tokens)
    if len(target_argmax) < k + 1:
        raise ValueError(f"need {k + 1} target argmaxes for {k} draft tokens, got {len(target_argmax)}")
    n = 0
    while n < k and int(draft_tokens[n]) == int(target_argmax[n]):
        n += 1
    return VerifyOutcome(n_accepted=n, next_token=int(target_argmax[n]))


def _token_prob_bounds(x: np.ndarray, top: float, temperature: float, token: int) -> tuple[float, float]:
    """(lower, upper) bounds on p(token) under softmax(x / T) (`_temperature_softmax`), from the near tokens alone.

    p(token) = e_t / S. The tokens within `_FAR_EXPONENT` of the top give S from below; each of the others adds at
    most e^-20 of the top token, which bounds S from above. Where many tokens are that close, the sum runs over the
    whole row instead (the far bound is then 0). Float32 exponentials, as the warp takes them, with `_BOUND_SLACK`.
    """
    top32, inv_t = np.float32(top), np.float32(1.0 / temperature)
    e_token = float(np.exp((x[token] - top32) * inv_t))
    close = x >= top - _FAR_EXPONENT * temperature * (1.0 + _BOUND_SLACK)
    n_close = int(np.count_nonzero(close))
    if 8 * n_close <= x.size:  # picking a few thousand tokens out costs less than exponentials of all of them
        near, s_far = np.extract(close, x), (x.size - n_close) * math.exp(-_FAR_EXPONENT)
    else:
        near, s_far = x, 0.0
    s_near = float(np.exp((near - top32) * inv_t).sum(dtype=np.float64))
    p_low = e_token * (1.0 - _BOUND_SLACK) / ((s_near + s_far) * (1.0 + _BOUND_SLACK))
    p_high = e_token * (1.0 + _BOUND_SLACK) / (s_near * (1.0 - _BOUND_SLACK))
    return p_low, p_high


class _RowsOnDemand:
    """A round's target logits rows, each transformed on first use and kept.

    Verification reads rows only up to the first rejection (and the row after it), so a long draft that fails early
    never pays for the rows after it.
    """

    def __init__(self, logits_rows: Sequence[np.ndarray] | np.ndarray) -> None:
        self._rows = logits_rows
        self._done: dict[int, Any] = {}

    def _transform(self, row: np.ndarray) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> Any:
        if i not in self._done:
            self._done[i] = self._transform(self._rows[i])
        return self._done[i]


class WarpedRows(_RowsOnDemand):
    """Each row warped on first use (a softmax over the whole vocabulary costs ~0.1 ms at 49k tokens).

    Plain temperature sampling can decide most acceptances without warping the row: see `accepts`.
    """

    def __init__(self, logits_rows: Sequence[np.ndarray] | np.ndarray, params: SamplingParams) -> None:
        super().__init__(logits_rows)
        self._params = params

    def _transform(self, row: np.ndarray) -> np.ndarray:
        return warp(row, self._params)

    def accepts(self, i: int, token: int, q: SparseDist | None, u: float) -> bool | None:
        """Whether `u < acceptance_probability(self[i], q, token)`, decided without warping row i when it is certain.

        p_i(token) = e_t / S: the token's exponential over their sum on the vocabulary (`_temperature_softmax`).
        The tokens within `_FAR_EXPONENT` of the top (a median 2.6k of 49k on SmolLM2 at T=0.7, measured) give S to
        within 1e-4, which settles u against min(1, p/q) unless u falls in that sliver: a pass over the row for the
        threshold and a short sum, ~50 us against ~125 us for the warp (2-core CPU); when many tokens are that close,
        the sum runs over the whole row (no normalised copy, ~90 us). A long n-gram draft of sampled text that is
        accepted reads a row per draft token. None when the bounds cannot tell, or for settings other than plain
        temperature sampling: the caller then warps the row. Draws nothing: the caller's u decides either way.
        """
        if i in self._done:
            return None
        row = self._rows[i]
        if getattr(row, "dtype", None) != np.float32 or not _plain_temperature(self._params, row.size):
            return None
        q_token = 1.0 if q is None else q.prob_of(token)
        if not q_token > 0.0:
            return None  # acceptance_probability raises for it
        x, top = _as_logits(row)
        p_low, p_high = _token_prob_bounds(x, top, self._params.temperature, token)
        if u < min(1.0, p_low / q_token) * (1.0 - _BOUND_SLACK):
            return True
        if u >= min(1.0, p_high / q_token) * (1.0 + _BOUND_SLACK):
            return False
        return None

    def sample(self, i: int, rng: np.random.Generator) -> int:
        """`sample(self[i], rng)`: the same token for the same uniform (up to rounding, see `sample_logits`), without
        warping row i for plain temperature sampling when nothing warped it yet."""
        row = self._rows[i]
        if i in self._done or not _plain_temperature(self._params, np.size(row)):
            return sample(self[i], rng)
        return sample_logits(row, self._params, rng)

    def sample_residual(self, i: int, token: int, q: SparseDist | None, rng: np.random.Generator) -> int:
        """`sample(residual_distribution(self[i], q, token), rng)`: the token after a rejection at row i.

        For plain temperature sampling of a row nothing warped yet, the residual is drawn from the float32 weights
        `sample_logits` draws from, edited where q has mass, without the normalised float64 row and its residual
        copy: ~160 us against ~430 us at 49k tokens on the 2-core CPU. max(0, p - q) over the weights w with sum S
        is max(0, w - q * S) / S, so only q's support changes: for an n-gram draft (q None) that is w[token] = 0,
        exact; for a model draft the changed weights are rounded to float32 (~6e-8 relative, below the float32
        exponentials' own ~1e-6). The same token as the warped path for the same uniform up to that rounding.
        """
        row = self._rows[i]
        plain = getattr(row, "dtype", None) == np.float32 and _plain_temperature(self._params, row.size)
        if i in self._done or not plain:
            return sample(residual_distribution(self[i], q, token), rng)
        x, top = _as_logits(row)
        w = _temperature_weights(x, top, self._params.temperature)
        total = float(w.sum(dtype=np.float64))
        if q is None:
            ids = np.array([token])
            new = np.zeros(1)
        else:
            ids = _support_in(q, w.size)
            new = np.maximum(0.0, w[ids].astype(np.float64) - q.probs * total)
        old = w[ids]  # a copy (fancy indexing)
        if (total - float(old.sum(dtype=np.float64)) + float(new.sum())) / total <= RESIDUAL_EPS:
            return _inverse_cdf(w, rng)  # no residual mass: p, as residual_distribution returns it
        w[ids] = new.astype(np.float32)
        return _inverse_cdf(w, rng)

    @property
    def warped(self) -> int:
        """Rows warped so far."""
        return len(self._done)


class ArgmaxRows(_RowsOnDemand):
    """Each row's greedy choice on first use: verify_greedy reads them only up to the first mismatch."""

    def _transform(self, row: np.ndarray) -> int:
        return int(row.argmax())


def verify_stochastic(
    target_probs: np.ndarray | WarpedRows,
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist | None],
    rng: np.random.Generator,
) -> VerifyOutcome:
    """Speculative-sampling verification of one round; output is distributed exactly as the target.

    target_probs has shape (k+1, V) and holds warped distributions, or is a WarpedRows: it warps only the rows read,
    and settles an acceptance from bounds where they decide it (`WarpedRows.accepts`, the same answer as
    acceptance_probability gives) and draws the token after a rejection from the residual of its weights
    (`WarpedRows.sample_residual`, the same token as residual_distribution and sample give up to rounding). Uses
    acceptance_probability, residual_distribution and sample (these pure functions ARE the implementation, so tests
    can enumerate through them, and the fast paths are tested against them). Draws one uniform per examined draft
    token, then one for the recovered/bonus token.
    With k == 0 it just samples from target_probs[0].
    """
    k = len(draft_tokens)
    if len(draft_dists) != k:
        raise ValueError(f"{k} draft tokens but {len(draft_dists)} draft distributions")
    if isinstance(target_probs, WarpedRows):
        if len(target_probs) != k + 1:
            raise ValueError(f"target_probs must have {k + 1} rows, got {len(target_probs)}")
    else:
        target_probs = np.asarray(target_probs, dtype=np.float64)
        if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
            raise ValueError(f"target_probs must have shape ({k + 1}, V), got {target_probs.shape}")
    lazy = isinstance(target_probs, WarpedRows)
    for i in range(k):
        token, q = int(draft_tokens[i]), draft_dists[i]
        u = rng.random()
        accepted = target_probs.accepts(i, token, q, u) if lazy else None
        if accepted is None:
            accepted = u < acceptance_probability(target_probs[i], q, token)
        if not accepted:
            if lazy:
                return VerifyOutcome(n_accepted=i, next_token=target_probs.sample_residual(i, token, q, rng))
            return VerifyOutcome(n_accepted=i, next_token=sample(residual_distribution(target_probs[i], q, token), rng))
    bonus = target_probs.sample(k, rng) if lazy else sample(target_probs[k], rng)
    return VerifyOutcome(n_accepted=k, next_token=bonus)
