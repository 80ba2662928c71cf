r"""Bayesian coresets by Accelerated Iterative Hard Thresholding (A-IHT I and II).

The coreset problem of CoreSet-PFedBayes (docs/papers/coreset_pfedbayes.md#s2-3; Zhang, Khanna, Kyrillidis,
Koyejo, AISTATS 2021): given Monte-Carlo projections of the data points' log-likelihoods, the columns
``Φ[:, j]`` (``J`` samples, centred), and ``y = Φ 1`` (the full data set), find sparse non-negative weights

.. math::

    \min_{w}\; f(w) = \|y - \Phi w\|_2^2 \quad \text{s.t. } \|w\|_0 \le k,\; w \ge 0
    \;[\text{and optionally } \textstyle\sum_j w_j = L].

A-IHT I (docs/papers/coreset_pfedbayes.md#s2-4, Alg. 2), from ``w_0 = z_0 = 0``:

.. math::

    \nabla = -2\Phi^\top(y - \Phi z_t),\quad S = \mathrm{supp}(z_t) \cup T_k,\quad
    \mu_t = \frac{\|\nabla_S\|^2}{2\|\Phi\nabla_S\|^2},\quad
    w_{t+1} = \Pi_{k,+}(z_t - \mu_t \nabla),

where ``T_k`` holds the ``k`` largest ``|∇_j|`` outside ``supp(z_t)``, ``μ_t`` is the exact line search
along the gradient restricted to ``S`` and ``Π_{k,+}`` keeps the ``k`` largest *signed* entries and clips
negatives to zero (the exact projection onto ``{‖w‖_0 ≤ k, w ≥ 0}``; one reference variant takes the top-k
of ``|b|``, which is not). Then the momentum step with the exact line search

.. math::

    d = w_{t+1} - w_t,\quad \tau_{t+1} = \frac{\langle y - \Phi w_{t+1}, \Phi d\rangle}{\|\Phi d\|^2},\quad
    z_{t+1} = w_{t+1} + \tau_{t+1} d

(**corrected**: the paper's τ has a spurious factor 2, docs/papers/coreset_pfedbayes.md#e9). Zero denominators
are guarded: a zero ``‖Φ∇_S‖`` means ``z_t`` is stationary (stop), a zero ``‖Φd‖`` gives ``τ = 0``. Stop when
``‖w_{t+1} − w_t‖ < tol·‖w_{t+1}‖`` (from the second iteration) or after ``max_iter``.

A-IHT II (``debias=True``) adds, after the projection, one exact gradient step on the support of
``w_{t+1}`` followed by clipping at zero (support unchanged; with ``sum_to`` the projection onto
``{w ≥ 0, Σw = L}`` on that support instead, so the sum constraint holds). ``step_scale = 0.5`` reproduces the
reference code's half step (it uses ``Φᵀr`` where the gradient is ``−2Φᵀr``). ``sum_to = L`` replaces the
clipping by the projection of the selected ``k`` entries onto ``{w ≥ 0, Σw = L}`` (the authors' ``L``;
CoreSet-PFedBayes' option ``sum_to = n``).

Everything has fixed shapes (supports are boolean masks, top-k by ``lax.top_k``) inside one
``lax.while_loop``, so :func:`aiht` jit-compiles and vmaps over problems (clients). It runs in the dtype of
its inputs: float32 reaches relative changes of about ``1e-5``; pass float64 arrays (with
``jax_enable_x64``) for tighter tolerances.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.utils import is_concrete

__all__ = [
    "AIHTResult",
    "AIHTTrace",
    "projected_potentials",
    "project_sparse_nonnegative",
    "coreset_objective",
    "aiht",
]


class AIHTTrace(NamedTuple):
    """Per-iteration values of :func:`aiht` with ``trace=True`` (``[max_iter]`` each; entries past the last
    iteration are NaN, ``support`` −1).

    Attributes:
      step_objective: ``f(z_t − μ_t ∇_S)``, after the exact line search along the restricted gradient (never
        above ``f(z_t)``: the step size 0 is a candidate).
      objective: ``f(w_{t+1})`` after the projection (not monotone in general: the projection can increase
        ``f``).
      momentum_objective: ``f(z_{t+1})`` after the momentum step (never above ``f(w_{t+1})``: ``τ = 0`` is a
        candidate of its exact line search).
      start_objective: ``f(z_t)``.
      support: ``‖w_{t+1}‖_0``.
      min_weight: ``min_j w_{t+1, j}``.
    """

    step_objective: jax.Array
    objective: jax.Array
    momentum_objective: jax.Array
    start_objective: jax.Array
    support: jax.Array
    min_weight: jax.Array


class AIHTResult(NamedTuple):
    """The output of :func:`aiht`.

    Attributes:
      weights: ``w [n]``, non-negative with at most ``k`` nonzero entries.
      objective: ``f(w) = ‖y − Φw‖²``.
      iterations: the number of iterations run.
      converged: the relative change fell below ``tol`` (or the iterate was stationary) before
        ``max_iter``.
      trace: :class:`AIHTTrace` with ``trace=True``, else ``None``.
    """

    weights: jax.Array
    objective: jax.Array
    iterations: jax.Array
    converged: jax.Array
    trace: AIHTTrace | None = None


def projected_potentials(log_likelihoods: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""The Monte-Carlo projection of the coreset objective (Eq. 3; docs/papers/coreset_pfedbayes.md#s2-3,
    Prop. 2): from the points' log-likelihoods ``L[s, j] = ℓ_j(θ_s)`` at ``J`` samples ``θ_s ~ π̂``,

    .. math::

        \Phi[s, j] = \frac{L[s, j] - \frac1J\sum_{s'} L[s', j]}{\sqrt J}, \qquad y = \Phi\,\mathbf 1,

    so that ``‖y − Φw‖²`` estimates ``E_π̂[(Σ_j (1 − w_j)(ℓ_j − E_π̂ ℓ_j))²]``.

    Returns ``(y [J], Φ [J, n])``."""
    ll = jnp.asarray(log_likelihoods)
    if ll.ndim != 2 or ll.shape[0] < 2:
        raise ValueError(f"log_likelihoods must be [J >= 2 samples, n points], got shape {ll.shape}")
    phi = (ll - jnp.mean(ll, axis=0, keepdims=True)) / jnp.sqrt(jnp.asarray(ll.shape[0], ll.dtype))
    return jnp.sum(phi, axis=1), phi


def coreset_objective(y: jax.Array, phi: jax.Array, w: jax.Array) -> jax.Array:
    """``f(w) = ‖y − Φw‖²``.

    Raises:
      ValueError: concrete weights that are negative or not finite (coreset weights are ``w ≥ 0``)."""
    if is_concrete(w):
        wn = np.asarray(w)
        if not np.all(np.isfinite(wn)):
            raise ValueError("w must be finite coreset weights (found NaN or inf)")
        if np.any(wn < 0):
            raise ValueError(f"w must be non-negative coreset weights, found {wn[wn < 0][:3].tolist()}")
    return _objective(y, phi, w)


def _objective(y, phi, w):
    r = y - phi @ w
    return jnp.dot(r, r)


def _simplex_on(values: jax.Array, total, valid: jax.Array | None = None) -> jax.Array:
    """Projection of ``values [k]`` (sorted descending) onto ``{v ≥ 0, Σv = total}`` (Duchi et al. 2008);
    with ``valid`` (a prefix of True) only those entries, the others set to 0."""
    k = values.shape[0]
    valid = jnp.ones((k,), bool) if valid is None else valid
    vals = jnp.where(valid, values, 0.0)
    cssv = jnp.cumsum(vals) - total
    ind = jnp.arange(1, k + 1, dtype=values.dtype)
    rho = jnp.sum(valid & (vals - cssv / ind > 0))
    theta = cssv[jnp.maximum(rho - 1, 0)] / jnp.maximum(rho, 1).astype(values.dtype)
    return jnp.where(valid, jnp.maximum(vals - theta, 0.0), 0.0)


def project_sparse_nonnegative(
    b: jax.Array, k: int, sum_to=None, allowed: jax.Array | None = None
) -> jax.Array:
    """``Π_{k,+}(b)``: the ``k`` largest signed entries of ``b`` kept, negatives clipped to zero (the
    Euclidean projection onto ``{‖w‖_0 ≤ k, w ≥ 0}``); with ``sum_to = L`` the kept entries are projected
    onto ``{w ≥ 0, Σw = L}`` instead of clipped. ``allowed`` (a boolean mask) restricts the support."""
    scores = b if allowed is None else jnp.where(allowed, b, -jnp.inf)
    values, idx = jax.lax.top_k(scores, k)
    valid = jnp.isfinite(values) if allowed is not None else None
    if sum_to is None:
        kept = jnp.maximum(values, 0.0) if valid is None else jnp.where(valid, jnp.maximum(values, 0.0), 0.0)
    else:
        kept = _simplex_on(values, jnp.asarray(sum_to, b.dtype), valid)
    return jnp.zeros_like(b).at[idx].set(kept)


def _masked_top(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
    """Boolean mask of the ``k`` largest ``scores`` among ``allowed`` entries (fewer if fewer are allowed)."""
    _, idx = jax.lax.top_k(jnp.where(allowed, scores, -jnp.inf), k)
    chosen = jnp.zeros(scores.shape, bool).at[idx].set(True)
    return chosen & allowed


def _line_step(phi, g, direction_norm2):
    """``‖g‖² / (2‖Φg‖²)`` with the zero-denominator guard (0 when ``Φg = 0``)."""
    pg = phi @ g
    den = 2.0 * jnp.dot(pg, pg)
    return jnp.where(den > 0, direction_norm2 / jnp.where(den > 0, den, 1.0), 0.0), den > 0


def _check(y, phi, k, max_iter, tol, step_scale, sum_to):
    y = jnp.asarray(y)
    phi = jnp.asarray(phi)
    if phi.ndim != 2 or y.shape != (phi.shape[0],):
        raise ValueError(f"phi must be [J, n] and y [J] with the same J, got {phi.shape} and {y.shape}")
    n = phi.shape[1]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be an integer >= 1 (the coreset size), got {k!r}")
    if k > n:
        raise ValueError(f"k must be at most the number of points n = {n}, got k = {k}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if not (isinstance(tol, numbers.Real) and tol >= 0 and np.isfinite(tol)):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    if not (isinstance(step_scale, numbers.Real) and 0 < step_scale <= 1):
        raise ValueError(
            f"step_scale must be in (0, 1] (1: exact line search, 0.5: reference code), got {step_scale!r}"
        )
    if sum_to is not None and is_concrete(sum_to):
        total = np.asarray(sum_to)
        if total.shape != () or not (np.isfinite(total) and total > 0):
            raise ValueError(f"sum_to must be None or a finite number > 0, got {sum_to!r}")
    for name, a in (("y", y), ("phi", phi)):
        if is_concrete(a) and not np.all(np.isfinite(np.asarray(a))):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    dtype = jnp.result_type(y.dtype, phi.dtype, float)
    return y.astype(dtype), phi.astype(dtype), int(k)


def aiht(
    y: jax.Array,
    phi: jax.Array,
    k: int,
    *,
    max_iter: int = 300,
    tol: float = 1e-5,
    step_scale: float = 1.0,
    debias: bool = False,
    sum_to: float | None = None,
    trace: bool = False,
) -> AIHTResult:
    """Accelerated IHT for sparse non-negative coreset weights (module docstring;
    docs/papers/coreset_pfedbayes.md#s2-4).

    Args:
      y: ``[J]`` target (``Φ 1`` for a Bayesian coreset).
      phi: ``[J, n]`` the points' centred log-likelihood projections.
      k: the coreset size (static), ``1 ≤ k ≤ n``.
      max_iter: iteration cap (static).
      tol: relative-change stopping tolerance.
      step_scale: multiplies the exact line-search step (1: the paper; 0.5: the reference code).
      debias: A-IHT II (a de-bias gradient step on the support after each projection).
      sum_to: optional total ``L`` of the weights (``None``: no sum constraint); a number or a traced
        scalar (e.g. a client's number of examples under ``vmap``).
      trace: also return the per-iteration :class:`AIHTTrace` (static; ``max_iter`` floats per field).

    Returns:
      :class:`AIHTResult`.

    Raises:
      ValueError: on shapes, ``k`` outside ``[1, n]``, non-finite concrete inputs or bad options.
    """
    y, phi, k = _check(y, phi, k, max_iter, tol, step_scale, sum_to)
    total = jnp.asarray(0.0 if sum_to is None else sum_to, y.dtype)
    statics = (int(max_iter), float(tol), float(step_scale), bool(debias), sum_to is not None, bool(trace))
    return _aiht(y, phi, total, k, *statics)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 8, 9))
def _aiht(y, phi, total, k, max_iter, tol, step_scale, debias, use_sum, trace):
    n = phi.shape[1]
    sum_to = total if use_sum else None

    def f(v):
        return _objective(y, phi, v)

    zero = jnp.zeros((n,), y.dtype)

    def grad(v):
        return -2.0 * (phi.T @ (y - phi @ v))

    def body(state):
        t, w, z, _, hist = state
        g = grad(z)
        in_z = z != 0
        support = in_z | _masked_top(jnp.abs(g), ~in_z, k)
        g_s = jnp.where(support, g, 0.0)
        mu, moving = _line_step(phi, g_s, jnp.dot(g_s, g_s))
        w_new = project_sparse_nonnegative(z - step_scale * mu * g, k, sum_to)
        if debias:  # A-IHT II: an exact gradient step on the support of w_new, projected back
            on = w_new != 0
            g_x = jnp.where(on, grad(w_new), 0.0)
            mu_x, _ = _line_step(phi, g_x, jnp.dot(g_x, g_x))
            if sum_to is None:  # clipped at zero
                w_new = jnp.where(on, jnp.maximum(w_new - mu_x * g_x, 0.0), 0.0)
            else:  # onto {w >= 0, sum w = L} on the same support (clipping alone would break the sum)
                w_new = project_sparse_nonnegative(w_new - mu_x * g_x, k, sum_to, allowed=on)
        w_new = jnp.where(moving, w_new, w)  # a stationary z_t: keep w_t
        d = w_new - w
        pd = phi @ d
        den = jnp.dot(pd, pd)
        tau = jnp.where(den > 0, jnp.dot(y - phi @ w_new, pd) / jnp.where(den > 0, den, 1.0), 0.0)
        z_new = w_new + tau * d
        small = jnp.linalg.norm(d) < tol * jnp.linalg.norm(w_new)
        converged = ((t >= 1) & small) | ~moving
        if trace:
            row = (
                f(z - mu * g_s),
                f(w_new),
                f(z_new),
                f(z),
                jnp.sum(w_new != 0).astype(y.dtype),
                jnp.min(w_new),
            )
            hist = AIHTTrace(*(h.at[t].set(v) for h, v in zip(hist, row, strict=True)))
        return t + 1, w_new, z_new, converged, hist

    def cond(state):
        t, _, _, converged, _ = state
        return (t < max_iter) & ~converged

    nan = jnp.full((max_iter,), jnp.nan, y.dtype)
    hist0 = AIHTTrace(nan, nan, nan, nan, jnp.full((max_iter,), -1, y.dtype), nan) if trace else ()
    init = (jnp.int32(0), zero, zero, jnp.asarray(False), hist0)
    t, w, _, converged, hist = jax.lax.while_loop(cond, body, init)
    return AIHTResult(w, f(w), t, converged, hist if trace else None)
