"""Classification metrics: predictive log-probabilities, accuracy, NLL and expected calibration error.

Everything is pure ``jax.numpy`` with static shapes, so it runs under ``jit`` and ``vmap``. Inputs are
log-probabilities ``log_probs [..., C]`` (class axis last), integer labels ``y [...]`` and an optional mask
``[...]`` (an entry counts iff ``mask > 0``; ``None``: all count). Masked entries contribute an exact zero
(``where``, never a product), so a padding row's label or logits (even NaN or an out-of-range label)
cannot change a result; with no valid entry a mean is 0, not NaN.

Batched evaluation: each metric is a ratio of sums, so :func:`classification_stats` returns the sums
(:class:`ClassificationStats`, with the calibration histogram :class:`CalibrationStats`), batches' stats add
leaf by leaf (:func:`sum_stats`), and :func:`accuracy_from_stats`, :func:`nll_from_stats` and
:func:`ece_from_stats` turn the totals into the metrics, equal (up to float summation order) to the metric
of all examples at once. Counts are int32, so accuracy's numerator and every bin count are exact.

Bayesian / ensemble predictive (docs/papers/bpcfl.md#a5): with ``S`` samples ``θ_s``,
``p̄(c|x) = (1/S) Σ_s softmax(f(x, θ_s))_c``; :func:`predictive_average` returns ``log p̄`` computed in log
space, and the metrics of ``log p̄`` are the NLL ``-mean_i log p̄(y_i|x_i)``, accuracy
``mean_i 1[argmax_c p̄(c|x_i) = y_i]`` and ECE (docs/papers/bpcfl.md#a9).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DEFAULT_NUM_BINS",
    "CalibrationStats",
    "ClassificationStats",
    "log_predictive",
    "predictive_average",
    "accuracy",
    "nll",
    "ece",
    "calibration_bin_stats",
    "ece_bin_stats",
    "ece_from_stats",
    "classification_stats",
    "sum_stats",
    "accuracy_from_stats",
    "nll_from_stats",
]

DEFAULT_NUM_BINS = 10
"""Number of ECE bins: B = 10 as in Naeini et al. (2015), the value docs/papers/bpcfl.md#a9 recommends."""


class CalibrationStats(NamedTuple):
    """The reliability histogram of ECE over ``B`` equal-width confidence bins (sums, so batches add).

    Attributes:
      count: int32 ``[..., B]``: ``|B_b|``, the number of valid examples whose confidence falls in bin ``b``.
      confidence: float ``[..., B]``: ``Σ_{i ∈ B_b} conf_i``.
      correct: int32 ``[..., B]``: ``Σ_{i ∈ B_b} 1[ŷ_i = y_i]``.
    """

    count: jax.Array
    confidence: jax.Array
    correct: jax.Array


class ClassificationStats(NamedTuple):
    """Sufficient statistics of accuracy, NLL and ECE over a set of examples (sums, so batches add).

    Attributes:
      num_examples: int32 ``[...]``: the number of valid examples ``n``.
      num_correct: int32 ``[...]``: ``Σ_i 1[argmax_c log p(c|x_i) = y_i]``.
      nll_sum: float ``[...]``: ``-Σ_i log p(y_i|x_i)`` (nats).
      calibration: the :class:`CalibrationStats` histogram.
    """

    num_examples: jax.Array
    num_correct: jax.Array
    nll_sum: jax.Array
    calibration: CalibrationStats


def _check_num_bins(num_bins) -> int:
    if isinstance(num_bins, bool) or not isinstance(num_bins, numbers.Integral) or num_bins < 1:
        raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
    return int(num_bins)


def _check_labels(log_probs: jax.Array, y: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Checks the shapes (``log_probs [..., C]``, ``y`` and ``mask`` ``[...]``); returns the bool mask."""
    if log_probs.ndim < 1:
        raise ValueError(f"log_probs must have a class axis (last), got shape {log_probs.shape}")
    if y.shape != log_probs.shape[:-1]:
        raise ValueError(
            f"y must have shape {log_probs.shape[:-1]} (log_probs without its class axis), got {y.shape}"
        )
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    if mask is None:
        return jnp.ones(y.shape, bool)
    if mask.shape != y.shape:
        raise ValueError(f"mask must have the shape of y {y.shape}, got {mask.shape}")
    return mask > 0


def log_predictive(logits: jax.Array) -> jax.Array:
    """Log-probabilities of a classifier's logits: ``log softmax(z)_c = z_c - log Σ_k exp(z_k)`` (class
    axis last; ``jax.nn.log_softmax``, which subtracts ``max_k z_k`` first for stability)."""
    return jax.nn.log_softmax(logits, axis=-1)


def predictive_average(logits_samples: jax.Array, axis: int = 0) -> jax.Array:
    """Log of the sample-averaged predictive, ``log p̄(c|x) = log (1/S) Σ_s softmax(z_s)_c``.

    With ``l_s = log softmax(z_s)`` and ``m = max_s l_s`` (per class and example), computed in log space as

        log p̄ = m + log((1/S) Σ_s exp(l_s - m)) = logsumexp_s(l_s) - log S

    (docs/papers/bpcfl.md#a5). Writing the ``1/S`` inside the log, rather than subtracting ``log S`` from the
    logsumexp, is the same number in exact arithmetic and keeps identical samples exact more often. For
    ``S`` identical samples ``Σ_s exp(0) = S`` exactly and the mean is ``S · fl(1/S)`` (XLA turns the
    division by the constant ``S`` into a product with its rounded reciprocal): exactly 1 for many ``S``
    (every power of two; 6, but not 41), so ``log p̄ = l`` bit for bit; otherwise ``1 - 2^-24`` or
    ``1 + 2^-23``, and ``log p̄ = l`` up to the float32 ``log``'s absolute error near 1 (measured:
    1.5 · 2^-23 on CPU) plus half an ULP of ``l``, where ``(l + log S) - log S`` is off by up to an ULP of
    ``|l| + log S``. A non-finite ``m`` (every sample
    gives ``-inf``) is replaced by 0 (as in ``jax.nn.logsumexp``), so the result is ``-inf`` there, not NaN.
    ``S == 1`` returns ``log_softmax(z_1)`` itself.

    Args:
      logits_samples: logits with a sample axis ``axis`` and the class axis last, e.g. ``[S, n, C]``.
      axis: the sample axis (not the class axis).

    Returns:
      ``log p̄``: ``logits_samples`` without the sample axis, e.g. ``[n, C]``.
    """
    ndim = logits_samples.ndim
    if ndim < 2:
        raise ValueError(
            f"logits_samples must have a sample axis and a class axis, got shape {logits_samples.shape}"
        )
    if not -ndim <= axis < ndim or axis % ndim == ndim - 1:
        raise ValueError(
            f"axis must name a sample axis of a {ndim}-d array other than the class axis (last), got {axis}"
        )
    axis = axis % ndim
    num_samples = logits_samples.shape[axis]
    if num_samples < 1:
        raise ValueError("logits_samples must hold at least one sample along axis")
    lp = log_predictive(logits_samples)
    if num_samples == 1:
        return jnp.squeeze(lp, axis)
    m = jnp.max(lp, axis=axis)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    mean = jnp.sum(jnp.exp(lp - jnp.expand_dims(m, axis)), axis=axis) / jnp.asarray(num_samples, lp.dtype)
    return m + jnp.log(mean)


def _correct(log_probs: jax.Array, y: jax.Array) -> jax.Array:
    """``argmax_c log_probs = y`` (the first maximal class on ties, ``jnp.argmax``)."""
    return jnp.argmax(log_probs, axis=-1) == y


def _count(values: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(valid, values, 0), dtype=jnp.int32)


def _nll_sum(log_probs: jax.Array, y: jax.Array, valid: jax.Array) -> jax.Array:
    """``-Σ_valid log_probs[i, y_i]``; a valid label outside ``0..C-1`` picks NaN (never a wrapped class)."""
    in_range = (y >= 0) & (y < log_probs.shape[-1])
    picked = jnp.take_along_axis(log_probs, jnp.expand_dims(jnp.where(in_range, y, 0), -1), axis=-1)[..., 0]
    picked = jnp.where(in_range, picked, jnp.nan)
    return jnp.sum(jnp.where(valid, -picked, 0.0))  # +0.0, not -0.0, when nothing is valid


def _ratio(total: jax.Array, count: jax.Array, dtype) -> jax.Array:
    """``total · (1 / max(count, 1))``: a product with the rounded reciprocal, not a quotient.

    XLA rewrites a division by a compile-time constant, or by a scalar broadcast over a batch (as under
    ``vmap``), as this very product (``5 / 37`` becomes 0.13513514, not the correctly rounded 0.13513513).
    Writing the product makes every program compute the same bits, whether or not the number of examples is
    known when compiling and whether or not the evaluation is vmapped; it is within an ULP of the quotient.
    """
    reciprocal = jnp.asarray(1, dtype) / jnp.maximum(count, 1).astype(dtype)
    return total.astype(dtype) * reciprocal


def _float_dtype(log_probs: jax.Array):
    return log_probs.dtype if jnp.issubdtype(log_probs.dtype, jnp.floating) else jnp.float32


def calibration_bin_stats(
    confidence: jax.Array, correct: jax.Array, mask: jax.Array | None = None, num_bins: int = DEFAULT_NUM_BINS
) -> CalibrationStats:
    """Histogram of confidences into ``B = num_bins`` equal-width bins, docs/papers/bpcfl.md#a9.

    Bin ``b = 1..B`` is the right-closed interval ``I_b = ((b-1)/B, b/B]`` (Naeini et al. 2015), so a
    confidence exactly on an edge ``b/B`` belongs to the bin below it (``0.1`` to ``I_1`` when ``B = 10``)
    and ``1.0`` to ``I_B``. The edges are ``b/B`` rounded to the confidence's dtype (``float32(0.1)`` is in
    ``I_1``), and an example's bin is the number of inner edges ``1/B..(B-1)/B`` strictly below its
    confidence (comparisons, not ``ceil(conf·B)``, whose product can round across an edge). A confidence
    of 0 (impossible for a softmax) goes to ``I_1`` and one above 1 (rounding) to ``I_B``.

    Args:
      confidence: float ``[n]`` (or any shape): ``conf_i = max_c p̄(c|x_i)``.
      correct: bool ``[n]``: ``1[argmax_c p̄(c|x_i) = y_i]``.
      mask: optional ``[n]``; entries with ``mask <= 0`` are not counted.
      num_bins: ``B``.

    Returns:
      :class:`CalibrationStats` with bin axis ``[B]`` (bins in increasing confidence; index ``b - 1``).
    """
    num_bins = _check_num_bins(num_bins)
    if correct.shape != confidence.shape:
        raise ValueError(f"correct must have the shape of confidence {confidence.shape}, got {correct.shape}")
    if mask is not None and mask.shape != confidence.shape:
        raise ValueError(f"mask must have the shape of confidence {confidence.shape}, got {mask.shape}")
    valid = jnp.ones(confidence.shape, bool) if mask is None else mask > 0
    dtype = confidence.dtype if jnp.issubdtype(confidence.dtype, jnp.floating) else jnp.float32
    conf = confidence.reshape(-1).astype(dtype)
    # 1/B, ..., (B-1)/B rounded once to dtype, on the host: XLA may turn a division by B into a product
    # with the rounded 1/B (9 * float32(0.1) = 0.90000004, while float32(0.9) = 0.89999998)
    inner = jnp.asarray((np.arange(1, num_bins) / num_bins).astype(np.dtype(dtype)))
    bins = jnp.sum(conf[:, None] > inner, axis=-1)
    member = (bins[:, None] == jnp.arange(num_bins)) & valid.reshape(-1, 1)  # [n, B]
    return CalibrationStats(
        count=jnp.sum(member, axis=0, dtype=jnp.int32),
        confidence=jnp.sum(jnp.where(member, conf[:, None], 0.0), axis=0),
        correct=jnp.sum(member & correct.reshape(-1, 1), axis=0, dtype=jnp.int32),
    )


def ece_bin_stats(
    log_probs: jax.Array, y: jax.Array, mask: jax.Array | None = None, num_bins: int = DEFAULT_NUM_BINS
) -> CalibrationStats:
    """The ECE histogram (:func:`calibration_bin_stats`) of a predictive: ``conf_i = exp(max_c log_probs)``
    and ``correct_i = 1[argmax_c log_probs = y_i]`` (docs/papers/bpcfl.md#a9)."""
    valid = _check_labels(log_probs, y, mask)
    confidence = jnp.exp(jnp.max(log_probs, axis=-1))
    return calibration_bin_stats(confidence, _correct(log_probs, y), valid, num_bins)


def ece_from_stats(stats: CalibrationStats) -> jax.Array:
    """Expected calibration error of a histogram (docs/papers/bpcfl.md#a9, Naeini et al. 2015):

        ECE = Σ_b (|B_b| / n) · |acc(B_b) - conf(B_b)| = (1/n) Σ_b |Σ_{i∈B_b} 1[ŷ_i = y_i] - Σ_{i∈B_b} conf_i|

    with ``n = Σ_b |B_b|``; the second form needs no per-bin division, and an empty bin adds exactly 0.
    0 when ``n = 0``. Leading axes of ``stats`` (e.g. clients) are kept; the bin axis is the last.
    """
    n = jnp.sum(stats.count, axis=-1)
    gap = jnp.abs(stats.correct.astype(stats.confidence.dtype) - stats.confidence)
    return _ratio(jnp.sum(gap, axis=-1), n, stats.confidence.dtype)


def classification_stats(
    log_probs: jax.Array, y: jax.Array, mask: jax.Array | None = None, num_bins: int = DEFAULT_NUM_BINS
) -> ClassificationStats:
    """The sums behind :func:`accuracy`, :func:`nll` and :func:`ece` of ``log_probs [..., C]`` against
    ``y [...]`` over the valid entries (see :class:`ClassificationStats`)."""
    valid = _check_labels(log_probs, y, mask)
    correct = _correct(log_probs, y)
    confidence = jnp.exp(jnp.max(log_probs, axis=-1))
    return ClassificationStats(
        num_examples=_count(jnp.ones(y.shape, jnp.int32), valid),
        num_correct=_count(correct, valid),
        nll_sum=_nll_sum(log_probs, y, valid),
        calibration=calibration_bin_stats(confidence, correct, valid, num_bins),
    )


def sum_stats(stats, axis: int = 0):
    """Adds statistics (a :class:`ClassificationStats` or :class:`CalibrationStats`, or any pytree of sums)
    over ``axis`` of every leaf, e.g. the batch axis of ``lax.map``'s stacked per-batch stats."""
    return jax.tree.map(lambda a: jnp.sum(a, axis=axis, dtype=a.dtype), stats)


def accuracy_from_stats(stats: ClassificationStats) -> jax.Array:
    """``num_correct / max(num_examples, 1)`` (elementwise over any leading axes)."""
    return _ratio(stats.num_correct, stats.num_examples, stats.nll_sum.dtype)


def nll_from_stats(stats: ClassificationStats) -> jax.Array:
    """``nll_sum / max(num_examples, 1)`` (elementwise over any leading axes)."""
    return _ratio(stats.nll_sum, stats.num_examples, stats.nll_sum.dtype)


def accuracy(log_probs: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Top-1 accuracy ``(1/n) Σ_i 1[argmax_c log_probs[i, c] = y_i]`` over the ``n`` valid entries (0 if
    none). Argmax is invariant under ``log_softmax``, so logits work too; ties go to the first class."""
    valid = _check_labels(log_probs, y, mask)
    return _ratio(_count(_correct(log_probs, y), valid), _count(valid, valid), _float_dtype(log_probs))


def nll(log_probs: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean negative log-likelihood (cross-entropy, nats) ``-(1/n) Σ_i log_probs[i, y_i]`` over the ``n``
    valid entries (0 if none). ``log_probs`` must be normalised (:func:`log_predictive`,
    :func:`predictive_average`); for ``log_softmax(z)`` this is softmax cross-entropy. A valid entry whose
    label is outside ``0..C-1`` makes the result NaN (padding rows may carry any label)."""
    valid = _check_labels(log_probs, y, mask)
    return _ratio(_nll_sum(log_probs, y, valid), _count(valid, valid), _float_dtype(log_probs))


def ece(
    log_probs: jax.Array, y: jax.Array, mask: jax.Array | None = None, num_bins: int = DEFAULT_NUM_BINS
) -> jax.Array:
    """Expected calibration error of a predictive with ``B = num_bins`` equal-width bins ``((b-1)/B, b/B]``
    (docs/papers/bpcfl.md#a9): ``ECE = Σ_b (|B_b|/n) |acc(B_b) - conf(B_b)|`` with
    ``conf_i = max_c p̄(c|x_i)``; see :func:`calibration_bin_stats` for the binning and :func:`ece_from_stats`
    for the formula."""
    return ece_from_stats(ece_bin_stats(log_probs, y, mask, num_bins))
