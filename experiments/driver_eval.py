"""How the driver evaluates a method: as its algorithm's :class:`sidejax.fl.Evaluation` says
(:func:`sidejax.fl.build_algorithm_evaluator`), nothing declared beside it.

``test_accuracy``/``test_loss``/``test_ece`` are the global model's (``evaluation.params``; an ensemble's
predictive average) on the test set: the dataset's test split, or with ``data.partition = "pfedme"`` the
union of the clients' test sets. A personalized method (``evaluation.personal`` set, which needs
``pfedme``'s per-client test sets) also logs :data:`experiments.driver_records.PERSONAL_COLUMNS`: every
client's personal model on its own test set, pooled over the clients (correct predictions / examples,
docs/papers/coreset_pfedbayes.md#s2-6).
"""

from __future__ import annotations

from typing import Any

import jax

from experiments.config import ExperimentConfig
from experiments.driver_records import PERSONAL_COLUMNS
from sidejax.fl import build_algorithm_evaluator

__all__ = ["check_evaluation", "Evaluator"]


def check_evaluation(config: ExperimentConfig, algorithm, client_test) -> None:
    """Checks that the data can evaluate ``algorithm`` (``client_test``: the per-client test sets, or
    ``None``), before anything is written.

    Raises:
      ValueError: a personalized method without per-client test sets (the partition).
    """
    if algorithm.evaluation.personal is not None and client_test is None:
        raise ValueError(
            f"{config.algorithm} is a personalized method: its personal models are evaluated on each "
            f"client's own test set, which data.partition={config.data.partition!r} does not give; use "
            f'data.partition = "pfedme" (with data.labels_per_client, data.examples_per_label and '
            f"data.train_fraction)"
        )


class Evaluator:
    """The compiled evaluation of a run: called with the state (on the host), the test columns' values.

    Args:
      algorithm: the :class:`sidejax.fl.Algorithm` (its ``evaluation``).
      apply_fn: the model's ``apply``.
      batch_size: the evaluation's batch size (``run.eval_batch_size``).
      test: ``(x_test, y_test)``, the common test set.
      client_test: the per-client test sets (:class:`experiments.driver.ClientTestSets`); used by a
        personalized method only.

    Attributes:
      personal: whether the method is personalized (logs :data:`PERSONAL_COLUMNS`).
      final_sample: which sample of an ensemble is the run's final model: the first (BPC-FL + SGD/Adam's
        MAP estimate is its one sample); ``None`` for one model.
    """

    def __init__(self, algorithm, apply_fn, *, batch_size, test, client_test):
        evaluation = algorithm.evaluation
        self.algorithm, self.test = algorithm, test
        self.personal = evaluation.personal is not None
        self.client_test = client_test if self.personal else None
        self.final_sample = 0 if evaluation.ensemble else None
        self._evaluate = build_algorithm_evaluator(evaluation, apply_fn, batch_size=batch_size)

    def __call__(self, state) -> dict[str, float]:
        """``test_accuracy``, ``test_loss``, ``test_ece`` of the global model, then (a personalized
        method) :data:`~experiments.driver_records.PERSONAL_COLUMNS`."""
        ev = self._evaluate(state, self.test, self.client_test)
        scores = {
            "test_accuracy": float(ev.model.accuracy),
            "test_loss": float(ev.model.loss),
            "test_ece": float(ev.model.ece),
        }
        if ev.personal is not None:
            scores.update(
                zip(PERSONAL_COLUMNS, (float(ev.personal.accuracy), float(ev.personal.loss)), strict=True)
            )
        return scores

    def unscored(self) -> dict[str, None]:
        """The columns of :meth:`__call__`, every one ``None``: a round that is not evaluated."""
        personal = PERSONAL_COLUMNS if self.personal else ()
        return dict.fromkeys(("test_accuracy", "test_loss", "test_ece", *personal))

    def final_model(self, state) -> tuple[Any, int | None]:
        """The run's final model (``eval_params``, or its sample ``final_sample``) and that sample index."""
        params = self.algorithm.eval_params(state)
        sample = self.final_sample
        if sample is not None:
            params = jax.tree.map(lambda a: a[sample], params)
        return params, sample
