"""How the driver evaluates a method, chosen from what the method declares (``MethodConfig.evaluation``) in
one table, :data:`EVALUATIONS`.

``test_accuracy``/``test_loss``/``test_ece`` are the global model's (``algorithm.eval_params``) on the test
set: the dataset's test split, or with ``data.partition = "pfedme"`` the union of the clients' test sets. A
personalized method (``evaluation = "personal"``: ``algorithm.personal_params``, which needs ``pfedme``'s
per-client test sets) also logs :data:`experiments.driver_records.PERSONAL_COLUMNS`: every client's personal
model on its own test set, pooled over the clients (correct predictions / examples,
docs/papers/coreset_pfedbayes.md#s2-6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from experiments.config import ExperimentConfig
from experiments.driver_records import PERSONAL_COLUMNS
from sidejax.fl import build_ensemble_evaluator, build_evaluator, build_personal_evaluator, client_mean

__all__ = ["Evaluation", "EVALUATIONS", "evaluation_of", "Evaluator"]


class Evaluation(NamedTuple):
    """One way of evaluating an algorithm.

    Attributes:
      eval_axis: the algorithm's ``eval_axis`` it expects (``None``: ``eval_params`` is one model;
        ``"sample"``: a leading sample axis).
      build: the :mod:`sidejax.fl` builder of the evaluator of ``eval_params`` on the common test set.
      personal: whether ``personal_params`` (one model per client) is also evaluated, each on its client's
        own test set (:func:`sidejax.fl.build_personal_evaluator`, pooled by :func:`sidejax.fl.client_mean`).
      final_sample: which sample of ``eval_params`` is the run's final model (``None``: all of it, one model).
    """

    eval_axis: str | None
    build: Callable
    personal: bool
    final_sample: int | None


#: ``MethodConfig.evaluation`` -> how the driver evaluates the method: one model, the predictive average of
#: an ensemble of samples (its first sample is the final model: BPC-FL + SGD/Adam's MAP estimate), or the
#: global model and every client's personal model
EVALUATIONS = {
    "model": Evaluation(eval_axis=None, build=build_evaluator, personal=False, final_sample=None),
    "ensemble": Evaluation(
        eval_axis="sample", build=build_ensemble_evaluator, personal=False, final_sample=0
    ),
    "personal": Evaluation(eval_axis=None, build=build_evaluator, personal=True, final_sample=None),
}


def evaluation_of(config: ExperimentConfig, algorithm, client_test) -> Evaluation:
    """The :class:`Evaluation` that ``config``'s method declares, checked against the built ``algorithm``
    and the data (``client_test``: the per-client test sets, or ``None``).

    Raises:
      ValueError: the method declares an evaluation its algorithm does not fit (a bug in the method's
        config), or a personalized method without per-client test sets (the partition).
    """
    method = config.method
    if method.evaluation not in EVALUATIONS:
        raise ValueError(
            f"{method.label()}: evaluation {method.evaluation!r} is not one of {', '.join(EVALUATIONS)}"
        )
    evaluation = EVALUATIONS[method.evaluation]
    has_personal = algorithm.personal_params is not None
    if algorithm.eval_axis != evaluation.eval_axis or has_personal != evaluation.personal:
        raise ValueError(
            f"{method.label()} declares evaluation {method.evaluation!r}, but its algorithm has "
            f"eval_axis={algorithm.eval_axis!r} and {'' if has_personal else 'no '}personal_params: the "
            f"driver evaluates a method as it declares; update {type(method).__name__}.evaluation"
        )
    if evaluation.personal and client_test is None:
        raise ValueError(
            f"{config.algorithm} is a personalized method: its personal models are evaluated on each "
            f"client's own test set, which data.partition={config.data.partition!r} does not give; use "
            f'data.partition = "pfedme" (with data.labels_per_client, data.examples_per_label and '
            f"data.train_fraction)"
        )
    return evaluation


class Evaluator:
    """The compiled evaluation of a run: called with the state (on the host), the test columns' values.

    Args:
      evaluation: how (:func:`evaluation_of`).
      algorithm: the :class:`sidejax.fl.Algorithm`.
      apply_fn: the model's ``apply``.
      batch_size: the evaluation's batch size (``run.eval_batch_size``).
      test: ``(x_test, y_test)``, the common test set.
      client_test: the per-client test sets (:class:`experiments.driver.ClientTestSets`) of a personalized
        method.
    """

    def __init__(self, evaluation: Evaluation, algorithm, apply_fn, *, batch_size, test, client_test):
        self.evaluation, self.algorithm = evaluation, algorithm
        self.test, self.client_test = test, client_test
        self._evaluate = jax.jit(evaluation.build(apply_fn, batch_size=batch_size))
        if evaluation.personal:
            self._personal = jax.jit(build_personal_evaluator(apply_fn, batch_size=batch_size))

    def __call__(self, state) -> dict[str, float]:
        """``test_accuracy``, ``test_loss``, ``test_ece`` of the global model, then (a personalized
        method) :data:`~experiments.driver_records.PERSONAL_COLUMNS`."""
        ev = self._evaluate(self.algorithm.eval_params(state), *self.test)
        scores = {"test_accuracy": float(ev.accuracy), "test_loss": float(ev.loss), "test_ece": float(ev.ece)}
        if self.evaluation.personal:
            ct = self.client_test
            pev = client_mean(self._personal(self.algorithm.personal_params(state), ct.x, ct.y, ct.mask))
            scores.update(zip(PERSONAL_COLUMNS, (float(pev.accuracy), float(pev.loss)), strict=True))
        return scores

    def unscored(self) -> dict[str, None]:
        """The columns of :meth:`__call__`, every one ``None``: a round that is not evaluated."""
        personal = PERSONAL_COLUMNS if self.evaluation.personal else ()
        return dict.fromkeys(("test_accuracy", "test_loss", "test_ece", *personal))

    def final_model(self, state) -> tuple[Any, int | None]:
        """The run's final model (``eval_params``, or its sample ``final_sample``) and that sample index."""
        params = self.algorithm.eval_params(state)
        sample = self.evaluation.final_sample
        if sample is not None:
            params = jax.tree.map(lambda a: a[sample], params)
        return params, sample
