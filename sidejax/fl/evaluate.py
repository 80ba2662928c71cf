"""Evaluation of classifiers on held-out sets, in fixed-size batches under ``lax.map``.

Three evaluators share one batched core: the examples are zero-padded to a multiple of the batch size and
masked, every batch yields the sufficient statistics of accuracy, NLL and ECE
(:func:`sidejax.metrics.classification_stats`: counts and sums), ``lax.map`` stacks them and their sum gives
the metrics. The result is therefore exact for any number of examples (padding counts nowhere, the counts
are integers) and memory holds one batch of activations at a time.

- :func:`build_evaluator`: one model ``params``.
- :func:`build_ensemble_evaluator`: params with a leading **sample** axis (posterior samples, an ensemble);
  the prediction is the predictive average ``p̄ = (1/S) Σ_s softmax(f(x, θ_s))``
  (:func:`sidejax.metrics.predictive_average`), and the metrics are those of ``p̄`` (docs/papers/bpcfl.md#a5).
- :func:`build_personal_evaluator`: params with a leading **client** axis, each evaluated on its own padded
  test set ``x [clients, n, ...]``; per-client results, reduced by :func:`client_mean`.

:func:`build_algorithm_evaluator` composes them as an algorithm's :class:`sidejax.fl.Evaluation` says: the
one evaluator of a round state, for every algorithm.

``apply_fn`` is called as ``apply_fn({'params': p}, x, train=False)`` and returns logits ``[batch, C]``.
The three model builders return pure, un-jitted functions (wrap them in ``jax.jit``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidejax.fl.base import Evaluation, RoundState
from sidejax.metrics import (
    DEFAULT_NUM_BINS,
    ClassificationStats,
    accuracy_from_stats,
    classification_stats,
    ece_from_stats,
    log_predictive,
    nll_from_stats,
    predictive_average,
    sum_stats,
)
from sidejax.types import Params

__all__ = [
    "EvalResult",
    "build_evaluator",
    "build_ensemble_evaluator",
    "build_personal_evaluator",
    "Scores",
    "build_algorithm_evaluator",
    "client_mean",
    "eval_result",
]


class EvalResult(NamedTuple):
    """Test metrics (each with the leading client axis for :func:`build_personal_evaluator`).

    Attributes:
      accuracy: top-1 accuracy in [0, 1].
      loss: mean negative log-likelihood (cross-entropy) in nats, ``-(1/n) Σ_i log p(y_i|x_i)``.
      num_examples: int32, the number of (valid) examples ``n``.
      ece: expected calibration error (docs/papers/bpcfl.md#a9, ``num_bins`` equal-width bins).

    With ``n = 0`` the metrics are 0 (and weigh nothing in :func:`client_mean`).
    """

    accuracy: jax.Array
    loss: jax.Array
    num_examples: jax.Array
    ece: jax.Array


def eval_result(stats: ClassificationStats) -> EvalResult:
    """The metrics of summed statistics (elementwise over any leading axes of ``stats``)."""
    return EvalResult(
        accuracy=accuracy_from_stats(stats),
        loss=nll_from_stats(stats),
        num_examples=stats.num_examples,
        ece=ece_from_stats(stats.calibration),
    )


def _check_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_data(x: jax.Array, y: jax.Array, mask: jax.Array | None, example_axes: int) -> None:
    """Shapes: ``x [*lead, n, ...]``, ``y [*lead, n]``, ``mask`` like ``y``, ``lead`` of example_axes - 1."""
    x, y = jnp.shape(x), jnp.shape(y)
    if len(y) != example_axes:
        what = "[n]" if example_axes == 1 else "[clients, n]"
        raise ValueError(f"y must have shape {what}, got {y}")
    if x[:example_axes] != y:
        raise ValueError(f"x must have the leading shape of y {y}, got x of shape {x}")
    if mask is not None and jnp.shape(mask) != y:
        raise ValueError(f"mask must have the shape of y {y}, got {jnp.shape(mask)}")


def _leading_axis(params: Params, name: str, what: str) -> int:
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(params)}
    if not sizes or None in sizes or len(sizes) != 1:
        raise ValueError(
            f"{name} must be a pytree whose every leaf has the same leading {what} axis, got leading sizes "
            f"{sorted(str(s) for s in sizes)}"
        )
    return sizes.pop()


def _batched_stats(
    log_probs_fn: Callable, x: jax.Array, y: jax.Array, mask: jax.Array | None, batch_size: int, num_bins: int
) -> ClassificationStats:
    """Sums ``classification_stats(log_probs_fn(x_b), y_b, mask_b)`` over batches ``b`` of ``x [n, ...]``.

    The batch is ``min(batch_size, n)`` (a small set is not padded up to ``batch_size``); the examples are
    zero-padded to a whole number of batches, and padding rows are masked out.
    """
    n = x.shape[0]
    size = max(min(batch_size, n), 1)
    num_batches = -(-n // size)
    pad = num_batches * size - n
    valid = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask) > 0
    xb = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(num_batches, size, *x.shape[1:])
    yb = jnp.pad(y, (0, pad)).reshape(num_batches, size)
    mb = jnp.pad(valid, (0, pad)).reshape(num_batches, size)

    def one(args):
        xi, yi, mi = args
        return classification_stats(log_probs_fn(xi), yi, mi, num_bins)

    return sum_stats(jax.lax.map(one, (xb, yb, mb)))


def _check_stacked(params_stacked, x, y, mask, *, data_axes: int, axis: str) -> int:
    """Checks the data (``data_axes`` leading axes on ``y``) and returns the params' leading-axis length."""
    _check_data(x, y, mask, data_axes)
    return _leading_axis(params_stacked, "params_stacked", axis)


def build_evaluator(apply_fn: Callable, *, batch_size: int = 1000, num_bins: int = DEFAULT_NUM_BINS):
    """Builds ``evaluate(params, x, y, mask=None) -> EvalResult`` for one model.

    Args:
      apply_fn: ``apply_fn({'params': p}, x, train=False) -> logits [batch, C]``.
      batch_size: examples per ``lax.map`` step (static; a smaller set runs as one batch of its size).
      num_bins: ECE bins ``B``.

    Returns:
      ``evaluate(params, x [n, ...], y [n], mask [n] | None)``: the metrics of ``log_softmax(logits)`` over
      the examples with ``mask > 0`` (all when ``mask`` is None). Not jitted.
    """
    batch_size = _check_int(batch_size, "batch_size")
    num_bins = _check_int(num_bins, "num_bins")

    def evaluate(params: Params, x: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> EvalResult:
        _check_data(x, y, mask, 1)
        log_probs = lambda xi: log_predictive(apply_fn({"params": params}, xi, train=False))
        return eval_result(_batched_stats(log_probs, x, y, mask, batch_size, num_bins))

    return evaluate


def _stacked_apply(apply_fn: Callable, params_stacked: Params, x: jax.Array, per_step: int) -> jax.Array:
    """Logits ``[S, batch, C]`` of every model in ``params_stacked`` (leading axis ``S``) on one batch ``x``.

    ``per_step == 1``: the models run one after another under ``lax.map`` (each call is the unbatched
    ``apply_fn``, the least memory); ``per_step > 1``: ``per_step`` models at a time under ``vmap``
    (``lax.map(..., batch_size=per_step)``; ``per_step >= S`` is one ``vmap`` over all of them).
    """
    one = lambda p: apply_fn({"params": p}, x, train=False)
    return jax.lax.map(one, params_stacked, batch_size=None if per_step == 1 else per_step)


def build_ensemble_evaluator(
    apply_fn: Callable, *, batch_size: int = 1000, num_bins: int = DEFAULT_NUM_BINS, samples_per_step: int = 1
):
    """Builds ``evaluate(params_stacked, x, y, mask=None) -> EvalResult`` for an ensemble / posterior samples.

    ``params_stacked`` holds ``S`` models ``θ_1..θ_S`` along a leading axis of every leaf. The prediction is
    the predictive average ``log p̄(c|x) = log (1/S) Σ_s softmax(f(x, θ_s))_c``
    (:func:`sidejax.metrics.predictive_average`), and the metrics are those of ``p̄``: NLL
    ``-mean_i log p̄(y_i|x_i)``, accuracy of ``argmax_c p̄``, ECE of ``max_c p̄`` (docs/papers/bpcfl.md#a5,
    docs/papers/bpcfl.md#a9).

    Memory: one batch of inputs and the logits ``[S, batch, C]`` of all samples on it, plus the activations
    of ``samples_per_step`` models at a time. ``S = 1`` runs ``apply_fn`` on the one model exactly as
    :func:`build_evaluator` does (same result bit for bit).

    Args:
      apply_fn: ``apply_fn({'params': p}, x, train=False) -> logits [batch, C]``.
      batch_size: examples per ``lax.map`` step (static).
      num_bins: ECE bins ``B``.
      samples_per_step: models evaluated at once on a batch: 1 runs them one at a time under ``lax.map``;
        ``k > 1`` vmaps ``k`` at a time (faster on accelerators, ``k`` times the activation memory).

    Returns:
      ``evaluate(params_stacked, x [n, ...], y [n], mask [n] | None)``. Not jitted.
    """
    batch_size, num_bins, samples_per_step = (
        _check_int(v, k)
        for k, v in dict(batch_size=batch_size, num_bins=num_bins, samples_per_step=samples_per_step).items()
    )

    def evaluate(params_stacked: Params, x, y, mask=None) -> EvalResult:
        num_samples = _check_stacked(params_stacked, x, y, mask, data_axes=1, axis="sample")
        if num_samples < 1:
            raise ValueError("params_stacked must hold at least one sample (its leading axis is empty)")

        if num_samples == 1:  # the average of one predictive is itself: no sample loop
            single = jax.tree.map(lambda a: a[0], params_stacked)
            log_probs = lambda xi: log_predictive(apply_fn({"params": single}, xi, train=False))
        else:
            log_probs = lambda xi: predictive_average(
                _stacked_apply(apply_fn, params_stacked, xi, samples_per_step), axis=0
            )

        return eval_result(_batched_stats(log_probs, x, y, mask, batch_size, num_bins))

    return evaluate


def build_personal_evaluator(
    apply_fn: Callable, *, batch_size: int = 1000, num_bins: int = DEFAULT_NUM_BINS, clients_per_step: int = 1
):
    """Builds ``evaluate(params_stacked, x, y, mask=None) -> EvalResult`` for personal (per-client) models.

    Client ``c``'s model ``params_stacked[c]`` (a leading client axis on every leaf) is evaluated on its
    own test set ``x[c], y[c]`` with ``mask[c]`` (padded to a common ``n``; ``mask`` None: every row is
    valid): the metrics :func:`build_evaluator` computes for ``(params[c], x[c], y[c], mask[c])``, in the same
    batches (equal up to the float rounding of two differently compiled programs). Reduce the per-client
    result with :func:`client_mean`.

    Memory: with ``clients_per_step = 1`` one client at a time (``lax.map``), one batch of it at a time;
    ``k > 1`` vmaps ``k`` clients at a time (faster on accelerators, ``k`` times the memory).

    Args:
      apply_fn: ``apply_fn({'params': p}, x, train=False) -> logits [batch, C]``.
      batch_size: examples per ``lax.map`` step within a client (static).
      num_bins: ECE bins ``B``.
      clients_per_step: clients evaluated at once.

    Returns:
      ``evaluate(params_stacked, x [clients, n, ...], y [clients, n], mask [clients, n] | None)``: an
      :class:`EvalResult` whose fields are ``[clients]``. Not jitted.
    """
    batch_size, num_bins, clients_per_step = (
        _check_int(v, k)
        for k, v in dict(batch_size=batch_size, num_bins=num_bins, clients_per_step=clients_per_step).items()
    )

    def evaluate(params_stacked: Params, x, y, mask=None) -> EvalResult:
        num_clients = _check_stacked(params_stacked, x, y, mask, data_axes=2, axis="client")
        if num_clients != y.shape[0]:
            raise ValueError(
                f"params_stacked has {num_clients} clients (leading axis) but x and y have {y.shape[0]}"
            )
        valid = jnp.ones(y.shape, bool) if mask is None else jnp.asarray(mask) > 0

        def one(args):
            params, xc, yc, mc = args
            log_probs = lambda xi: log_predictive(apply_fn({"params": params}, xi, train=False))
            return _batched_stats(log_probs, xc, yc, mc, batch_size, num_bins)

        per_step = None if clients_per_step == 1 else clients_per_step
        stats = jax.lax.map(one, (params_stacked, x, y, valid), batch_size=per_step)
        return eval_result(stats)

    return evaluate


def client_mean(result: EvalResult) -> EvalResult:
    """Example-weighted mean over the leading client axis of a per-client :class:`EvalResult`.

    ``metric = Σ_c n_c metric_c / Σ_c n_c`` and ``num_examples = Σ_c n_c``; clients with ``n_c = 0`` weigh
    nothing. For accuracy and loss this is the pooled value over all clients' examples (up to rounding). For
    ECE it is the mean of the clients' own ECEs (each personal model's calibration on its own data), which
    is at least the ECE of the pooled examples (triangle inequality, bin by bin).
    """
    n = result.num_examples
    total = jnp.sum(n, axis=0, dtype=jnp.int32)

    def mean(metric):  # a product with the reciprocal, as in sidejax.metrics (the same bits in any program)
        w = n.astype(metric.dtype)
        return jnp.sum(w * metric, axis=0) * (1 / jnp.maximum(total, 1).astype(metric.dtype))

    return EvalResult(
        accuracy=mean(result.accuracy), loss=mean(result.loss), num_examples=total, ece=mean(result.ece)
    )


class Scores(NamedTuple):
    """The scores of one round state (:func:`build_algorithm_evaluator`).

    Attributes:
      model: the global model's :class:`EvalResult` on the common test set (an ensemble: its predictive
        average's).
      personal: ``None``, or the personal models' results, each on its client's own test set, pooled over
        the clients by :func:`client_mean`.
    """

    model: EvalResult
    personal: EvalResult | None = None


def build_algorithm_evaluator(
    evaluation: Evaluation,
    apply_fn: Callable,
    *,
    batch_size: int = 1000,
    num_bins: int = DEFAULT_NUM_BINS,
    samples_per_step: int = 1,
    clients_per_step: int = 1,
):
    """Builds ``evaluate(state, test, client_test=None) -> Scores`` for an algorithm's
    :class:`sidejax.fl.Evaluation` (``algorithm.evaluation``): the one evaluator of every algorithm.

    The global model ``evaluation.params(state)`` is scored by :func:`build_evaluator`, or with
    ``evaluation.ensemble`` by :func:`build_ensemble_evaluator` (the samples' predictive average); a
    personalized method's ``evaluation.personal(state)`` (a leading axis over all clients) by
    :func:`build_personal_evaluator`, pooled by :func:`client_mean`.

    The models are read from the state where ``evaluate`` runs (on the host between rounds, as a driver
    does, or traced under an outer ``jax.jit``); the model evaluators are compiled here (``jax.jit``, once
    per input shape).

    Args:
      evaluation: the algorithm's :class:`sidejax.fl.Evaluation`.
      apply_fn: ``apply_fn({'params': p}, x, train=False) -> logits [batch, C]``.
      batch_size: examples per ``lax.map`` step (static).
      num_bins: ECE bins ``B``.
      samples_per_step: an ensemble's samples evaluated at once (:func:`build_ensemble_evaluator`).
      clients_per_step: personal models evaluated at once (:func:`build_personal_evaluator`).

    Returns:
      ``evaluate(state, test, client_test=None)``: ``test = (x [n, ...], y [n])`` or ``(x, y, mask)``, the
      common test set; ``client_test = (x [clients, n, ...], y [clients, n], mask [clients, n])``, every
      client's own test set (required exactly when ``evaluation.personal`` is set). A :class:`Scores`.

    Raises:
      ValueError: ``evaluation`` is not an :class:`sidejax.fl.Evaluation` (or its fields are not a callable
        ``params``, a bool ``ensemble``, a callable or ``None`` ``personal``); in ``evaluate``, a
        ``client_test`` missing for personal models or given without them.
    """
    if not isinstance(evaluation, Evaluation):
        raise ValueError(f"evaluation must be a sidejax.fl.Evaluation, got {type(evaluation).__name__}")
    if not callable(evaluation.params):
        raise ValueError(f"evaluation.params must be callable (state -> params), got {evaluation.params!r}")
    if not isinstance(evaluation.ensemble, bool):
        raise ValueError(f"evaluation.ensemble must be a bool, got {evaluation.ensemble!r}")
    if evaluation.personal is not None and not callable(evaluation.personal):
        raise ValueError(f"evaluation.personal must be None or callable, got {evaluation.personal!r}")
    common = dict(batch_size=batch_size, num_bins=num_bins)
    if evaluation.ensemble:
        model = build_ensemble_evaluator(apply_fn, **common, samples_per_step=samples_per_step)
    else:
        model = build_evaluator(apply_fn, **common)
    model = jax.jit(model)
    personal = None
    if evaluation.personal is not None:
        personal = jax.jit(build_personal_evaluator(apply_fn, **common, clients_per_step=clients_per_step))

    def evaluate(state: RoundState, test, client_test=None) -> Scores:
        if personal is not None and client_test is None:
            raise ValueError(
                "client_test (every client's own test set) is required: the evaluation has personal models"
            )
        if personal is None and client_test is not None:
            raise ValueError(
                "client_test was given, but the evaluation has no personal models (personal is None)"
            )
        scores = Scores(model(evaluation.params(state), *test))
        if personal is None:
            return scores
        return scores._replace(personal=client_mean(personal(evaluation.personal(state), *client_test)))

    return evaluate
