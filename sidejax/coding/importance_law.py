"""The exact law of the importance-sampled Bernoulli for block size 1, and the paper's bounds on its bias.

BICompFL (Sec. 5 and App. A; docs/papers/bicompfl.md#s6) analyses the scalar case of the coder in
:mod:`sidejax.coding.importance`: posterior :math:`Q = \\mathrm{Bern}(q)`, prior
:math:`P = \\mathrm{Bern}(p)`, :math:`p, q \\in (0, 1)`, candidates
:math:`X_1, \\dots, X_n \\stackrel{iid}{\\sim} P` (:math:`n = n_{IS}`), index :math:`I \\sim W`,
:math:`W(i) \\propto Q(X_i) / P(X_i)`, and the transmitted sample :math:`X_I`.

**Exact law** (the proof of Prop. 1 up to its eq. (1)). By symmetry over the candidates and because the
weights depend on the other candidates only through their number of ones
:math:`L = \\sum_{i \\ge 2} X_i \\sim \\mathrm{Bin}(n - 1, p)`,

.. math::

    \\Pr(X_I = 1) = n \\sum_{L=0}^{n-1} \\binom{n-1}{L} p^{L+1} (1-p)^{n-1-L}
        \\frac{q/p}{(L+1)\\,\\frac{q}{p} + (n-L-1)\\,\\frac{1-q}{1-p}}
      = q\\, \\mathbb{E}_{L \\sim \\mathrm{Bin}(n-1, p)}\\left[
        \\frac{1}{\\frac{L+1}{n}\\frac{q}{p} + \\frac{n-L-1}{n}\\frac{1-q}{1-p}}\\right],

computed by :func:`bernoulli_selection_prob` (float32 or whatever JAX's dtype is, under ``jit``) and
:func:`bernoulli_selection_prob_np` (a float64 numpy oracle). Special values: :math:`n = 1` gives
:math:`p`; :math:`q = p` gives :math:`p` for every :math:`n` (uniform weights); the law always lies
between :math:`p` and :math:`q` (IS is biased towards the prior) and :math:`|\\Pr - q|` is non-increasing
in :math:`n` (both checked numerically, docs/papers/bicompfl.md#s6 [D]).

**Bounds.**

- :func:`prop1_bound` (Prop. 1): :math:`|\\Pr(X_I=1) - q| \\le q\\,(\\max\\{p/q, (1-p)/(1-q), q/p,
  (1-q)/(1-p)\\} - 1)` for every :math:`n`; it vanishes at :math:`q = p` (the Chatterjee-Diaconis bound
  does not) and is attained at :math:`n = 1` when :math:`p > q` and :math:`p/q` is the maximum.
- :func:`lemma1_bound` (Lemma 1): with :math:`\\Delta = q/p - (1-q)/(1-p) = (q-p)/(p(1-p))`,
  :math:`\\Delta' = q\\,(p/q + (1-p)/(1-q)) = p + q(1-p)/(1-q)` and
  :math:`\\eta = \\sqrt{6 p \\log(2n) / n}` (:func:`lemma1_eta`, natural log),
  :math:`|\\Pr(X_I=1) - q| \\le \\Delta'/n^2 + O((|\\Delta| + \\Delta^2)\\,\\eta)`. The paper's :math:`O`
  has no constant; this module makes it an explicit ``constant`` :math:`C`. docs/papers/bicompfl.md#s6 found
  (and the tests check) that :math:`C = 1` holds on the grid :math:`p, q \\in [0.02, 0.98]`,
  :math:`n \\in \\{2, \\dots, 4096\\}`, with an implied constant of at most 0.017. The proof assumes
  :math:`p \\pm \\eta \\in [0, 1]` (its footnote 3: otherwise the concentration step is vacuous), which
  holds only for large :math:`n` away from the ends of :math:`(0, 1)`; on that grid :math:`C = 1` also
  holds where it fails.
- :func:`asymptotic_bias` (not in the paper, docs/papers/bicompfl.md#s6 [D]): the bias is :math:`O(1/n)`,
  tighter than Lemma 1's :math:`O(\\sqrt{\\log n / n})`: :math:`n\\,(\\Pr(X_I=1) - q) \\to -q(1-q)\\Delta`.
  (Expanding :math:`1/(1 + \\Delta (L + 1 - n p)/n)` to second order around :math:`L = np` with
  :math:`\\mathbb{E}[L + 1 - np] = 1 - p` and :math:`\\mathrm{Var}\\,L \\approx n p (1-p)` gives
  :math:`q\\,(-\\Delta(1-p) + \\Delta^2 p(1-p))/n = -q(1-q)\\Delta/n`.)

**Corrections to the paper's proofs** (docs/papers/bicompfl.md#s8-11; the formulas above are the corrected
ones).

- Prop. 1 proof: the sum over :math:`\\{x : x_i = i\\}` means :math:`x_i = 1`; :math:`\\binom{n-1}{L}`
  means :math:`\\binom{n_{IS}-1}{L}`. (Also, in the line before eq. (1) the factor after
  :math:`p^{L+1}(1-p)^{n-L-1}` must be :math:`q/p` over the weight sum, not :math:`q`; eq. (1) itself,
  with :math:`p^L`, is right. Found checking eq. (1) against the reference table,
  docs/papers/bicompfl.md#s8-11.)
- Lemma 1 proof: ``n eta`` means :math:`n_{IS}\\,\\eta_\\delta`; the Chernoff event is
  :math:`|L - n_{IS} p| \\ge \\varepsilon\\, n_{IS} p` (the printed centring
  :math:`L - \\varepsilon(n_{IS} p)` is garbled); :math:`L \\sim \\mathrm{Bin}(n_{IS} - 1, p)`, not
  :math:`\\mathrm{Bin}(n_{IS}, p)`. With :math:`\\delta = 1/n^2` the Chernoff radius is
  :math:`\\sqrt{3 p \\log(2 n^2) / n}`, which the paper rounds up to :math:`\\eta = \\sqrt{6 p \\log(2n)/n}`
  (a harmless over-estimate, docs/papers/bicompfl.md#s8-11). The "approximations up to second order" are
  heuristic, hence the unspecified constant.
- Sec. 5 misquotes Pinsker as :math:`|q - p| \\le \\frac12 \\sqrt{d_{KL}/2}`; it is
  :math:`|q - p| \\le \\sqrt{d_{KL}/2}` (nats).
- Theorem 1 proof (not implemented here: its :math:`O`-terms make it qualitative): the Hoeffding term must
  use :math:`n_{UL}` (an average of :math:`n_{UL}` samples), not :math:`n_{IS}`; a union bound over the
  clients is missing (probability :math:`1 - n\\delta'`); :math:`\\Delta_j` needs an absolute value.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.utils import check_number, is_concrete

__all__ = [
    "bernoulli_selection_prob",
    "bernoulli_selection_prob_np",
    "prop1_bound",
    "lemma1_eta",
    "lemma1_bound",
    "asymptotic_bias",
]


def _check_num_candidates(num_candidates) -> int:
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, numbers.Integral):
        raise ValueError(
            f"num_candidates must be a static int >= 1 (the number of IS candidates n_IS), got "
            f"{num_candidates!r}"
        )
    if num_candidates < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
    return int(num_candidates)


def _check_open_unit(x, name: str) -> None:
    """``ValueError`` naming ``name`` if a concrete ``x`` has entries outside the open interval (0, 1)."""
    if not is_concrete(x):
        return
    a = np.asarray(x, dtype=np.float64)
    bad = ~((a > 0) & (a < 1))
    if np.any(bad):
        raise ValueError(
            f"{name} must hold probabilities in the open interval (0, 1) (the law divides by {name} and "
            f"1 - {name}); found e.g. {a[bad].ravel()[:3].tolist()}"
        )


def _check_candidates_array(n) -> None:
    if is_concrete(n):
        a = np.asarray(n, dtype=np.float64)
        if not np.all(a >= 1):
            raise ValueError(f"num_candidates must be >= 1 everywhere, got e.g. {a[~(a >= 1)].ravel()[:3]}")


def _float_dtype(*xs):
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def bernoulli_selection_prob(q, p, num_candidates: int) -> jax.Array:
    """:math:`\\Pr(X_I = 1)` for the importance-sampled Bernoulli with ``num_candidates`` candidates.

    .. math::

        \\Pr(X_I = 1) = q\\, \\mathbb{E}_{L \\sim \\mathrm{Bin}(n-1, p)}\\left[
            \\frac{1}{\\frac{L+1}{n}\\frac{q}{p} + \\frac{n-L-1}{n}\\frac{1-q}{1-p}}\\right]

    (module docstring). Vectorised over broadcast ``q`` and ``p``; ``num_candidates`` is static, and the
    work is ``O(size * n)`` (arrays of shape ``broadcast(q, p).shape + (n,)``).

    Numerics: the binomial weights span thousands of nats at large ``n`` (:math:`\\log\\binom{4095}{2048}
    \\approx 2836`), so they are never formed from ``gammaln`` (whose float32 result at
    :math:`\\log\\Gamma(4096) \\approx 3 \\cdot 10^4` is only good to about 0.002). Instead the log-weights
    are accumulated **outward from the mode** :math:`m = \\lfloor n p \\rfloor` from the ratios
    :math:`\\log \\frac{\\Pr(L=k+1)}{\\Pr(L=k)} = \\log\\frac{n-1-k}{k+1} + \\mathrm{logit}\\, p` (two
    masked cumulative sums), so the weights that matter are near 0 in log space, and are normalised by their
    sum (the constant :math:`\\log \\Pr(L = m)` is never needed). The likelihood ratios
    :math:`q/p` and :math:`(1-q)/(1-p)` enter scaled by their maximum (no overflow for normal floats).
    In float32 the result is within 5 ulp of the float64 law at the same (float32) inputs on the grid of
    docs/papers/bicompfl.md#s6 for ``n`` up to 4096 (measured 4.7; the test allows 8).

    Args:
      q: posterior probabilities in (0, 1) (any shape).
      p: prior probabilities in (0, 1), broadcastable with ``q``.
      num_candidates: the number of candidates :math:`n = n_{IS} \\ge 1` (a static int; the coder uses
        powers of two, the law holds for any ``n``).

    Returns:
      :math:`\\Pr(X_I = 1)`, shape ``broadcast(q, p)``, in the floating dtype of the inputs (at least
      float32). Exactly ``p`` where ``q == p`` and for ``n = 1``. Inside ``jit`` entries with ``q`` or ``p``
      outside (0, 1) are NaN; concrete ones raise ``ValueError``.
    """
    n = _check_num_candidates(num_candidates)
    _check_open_unit(q, "q")
    _check_open_unit(p, "p")
    dt = _float_dtype(q, p)
    q, p = jnp.broadcast_arrays(jnp.asarray(q, dt), jnp.asarray(p, dt))
    ok = (q > 0) & (q < 1) & (p > 0) & (p < 1)
    if n == 1:
        return jnp.where(ok, p, jnp.nan)
    qq, pp = q[..., None], p[..., None]
    k = jnp.arange(n - 1, dtype=dt)
    # log Pr(L = k + 1) - log Pr(L = k), k = 0 .. n-2
    ratio = jnp.log((n - 1 - k) / (k + 1)) + (jnp.log(pp) - jnp.log1p(-pp))
    mode = jnp.clip(jnp.floor(n * pp), 0, n - 1)
    # L >= mode: sum of ratios k in [mode, L); L < mode: minus the sum over k in [L, mode)
    up = jnp.cumsum(jnp.where(k >= mode, ratio, 0), axis=-1)
    down = jnp.flip(jnp.cumsum(jnp.flip(jnp.where(k < mode, ratio, 0), -1), axis=-1), -1)
    zero = jnp.zeros_like(up[..., :1])
    log_w = jnp.concatenate([zero, up], -1) - jnp.concatenate([down, zero], -1)
    w = jnp.exp(log_w)  # the mode's weight is 1; the others underflow harmlessly in the tails
    r1, r0 = qq / pp, (1 - qq) / (1 - pp)
    top = jnp.maximum(r1, r0)
    L = jnp.arange(n, dtype=dt)
    den = ((L + 1) / n) * (r1 / top) + ((n - 1 - L) / n) * (r0 / top)  # in [min / max, 1]
    prob = (q / top[..., 0]) * (jnp.sum(w / den, axis=-1) / jnp.sum(w, axis=-1))
    prob = jnp.where(q == p, p, prob)
    return jnp.where(ok, prob, jnp.nan)


_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def bernoulli_selection_prob_np(q, p, num_candidates: int) -> np.ndarray:
    """Float64 numpy twin of :func:`bernoulli_selection_prob` (an oracle for tests; not jittable).

    A different algorithm on purpose: the binomial log-pmf directly from ``math.lgamma`` (ample in float64:
    about :math:`10^{-11}` relative at :math:`n = 4096`) and a log-sum-exp over :math:`L`. Same special
    values (``p`` exactly at ``q == p`` and ``n = 1``) and the same ``ValueError`` for arguments outside
    (0, 1).
    """
    n = _check_num_candidates(num_candidates)
    _check_open_unit(q, "q")
    _check_open_unit(p, "p")
    q, p = np.broadcast_arrays(np.asarray(q, np.float64), np.asarray(p, np.float64))
    if n == 1:
        return p.copy()
    L = np.arange(n, dtype=np.float64)
    log_binom = _lgamma(n) - _lgamma(L + 1) - _lgamma(n - L)
    qq, pp = q[..., None], p[..., None]
    log_pmf = log_binom + L * np.log(pp) + (n - 1 - L) * np.log1p(-pp)
    r1, r0 = qq / pp, (1 - qq) / (1 - pp)
    log_den = np.log(((L + 1) * r1 + (n - 1 - L) * r0) / n)
    a = log_pmf - log_den
    top = a.max(axis=-1, keepdims=True)
    prob = q * np.exp(top[..., 0]) * np.exp(a - top).sum(axis=-1)
    return np.where(q == p, p, prob)


def prop1_bound(q, p) -> jax.Array:
    """Prop. 1: :math:`|\\Pr(X_I = 1) - q| \\le q\\,(\\max\\{p/q, (1-p)/(1-q), q/p, (1-q)/(1-p)\\} - 1)`.

    Holds for every number of candidates; 0 at ``q == p``; equal to :math:`p - q`, the bias at
    :math:`n = 1`, when :math:`p/q` is the maximum. Elementwise over broadcast ``q``, ``p`` in (0, 1).
    """
    _check_open_unit(q, "q")
    _check_open_unit(p, "p")
    dt = _float_dtype(q, p)
    q, p = jnp.asarray(q, dt), jnp.asarray(p, dt)
    # q (r - 1) for each ratio r, written with the difference q - p (exact for close q, p) instead of
    # subtracting 1 from a ratio near 1, which would cost float32 digits where the bound is small
    d = q - p
    return jnp.maximum(jnp.maximum(-d, q * d / (1 - q)), jnp.maximum(q * d / p, -q * d / (1 - p)))


def lemma1_eta(p, num_candidates) -> jax.Array:
    """Lemma 1's concentration radius :math:`\\eta = \\sqrt{6 p \\log(2 n) / n}` (natural log).

    The proof assumes :math:`p - \\eta \\ge 0` and :math:`p + \\eta \\le 1`. ``num_candidates`` may be an
    array (elementwise, broadcast with ``p``).
    """
    _check_open_unit(p, "p")
    _check_candidates_array(num_candidates)
    dt = _float_dtype(p, num_candidates)
    p, n = jnp.asarray(p, dt), jnp.asarray(num_candidates, dt)
    return jnp.sqrt(6 * p * jnp.log(2 * n) / n)


def lemma1_bound(q, p, num_candidates, constant: float = 1.0) -> jax.Array:
    """Lemma 1 with an explicit constant :math:`C` in place of the paper's :math:`O`:

    .. math::

        |\\Pr(X_I = 1) - q| \\le \\frac{\\Delta'}{n^2} + C\\,(|\\Delta| + \\Delta^2)\\,
            \\sqrt{\\frac{6 p \\log(2n)}{n}},\\qquad
        \\Delta = \\frac{q}{p} - \\frac{1-q}{1-p},\\quad \\Delta' = p + \\frac{q(1-p)}{1-q}.

    The paper states it with :math:`O(\\cdot)` and no constant; docs/papers/bicompfl.md#s6 ([D]) found that
    :math:`C = 1` holds on the grid :math:`p, q \\in [0.02, 0.98]`, :math:`n \\in \\{2, 4, \\dots, 4096\\}`
    (implied constant at most 0.017), which the tests re-check. Validity condition of the proof:
    :math:`p \\pm \\eta \\in [0, 1]` with :math:`\\eta` = :func:`lemma1_eta`. Elementwise over broadcast
    ``q``, ``p`` and ``num_candidates`` (which may be an array here).
    """
    _check_open_unit(q, "q")
    _check_open_unit(p, "p")
    constant = check_number(
        constant, "constant", "a number >= 0 (the O-constant of Lemma 1)", lambda x: x >= 0
    )
    dt = _float_dtype(q, p, num_candidates)
    q, p, n = jnp.asarray(q, dt), jnp.asarray(p, dt), jnp.asarray(num_candidates, dt)
    delta = (q - p) / (p * (1 - p))  # = q/p - (1-q)/(1-p), without the cancellation near q = p
    delta_prime = p + q * (1 - p) / (1 - q)
    return delta_prime / n**2 + constant * (jnp.abs(delta) + delta**2) * lemma1_eta(p, num_candidates)


def asymptotic_bias(q, p, num_candidates) -> jax.Array:
    """The leading term of the bias: :math:`\\Pr(X_I = 1) - q \\approx -q(1-q)(q-p) / (p(1-p)\\,n)`.

    :math:`n\\,(\\Pr(X_I=1) - q) \\to -q(1-q)\\Delta` as :math:`n \\to \\infty` (module docstring;
    docs/papers/bicompfl.md#s6 [D]: relative error below 0.35% at :math:`n = 4096` for
    :math:`p, q \\in [0.1, 0.9]`). Negative when :math:`q > p` and positive when :math:`q < p`: towards the
    prior.
    """
    _check_open_unit(q, "q")
    _check_open_unit(p, "p")
    _check_candidates_array(num_candidates)
    dt = _float_dtype(q, p, num_candidates)
    q, p, n = jnp.asarray(q, dt), jnp.asarray(p, dt), jnp.asarray(num_candidates, dt)
    return -q * (1 - q) * (q - p) / (p * (1 - p)) / n
