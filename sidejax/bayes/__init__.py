"""Bayesian tools: :mod:`sidejax.bayes.coresets` (sparse non-negative coreset weights by Accelerated IHT)."""

from sidejax.bayes.coresets import (
    AIHTResult,
    aiht,
    coreset_objective,
    project_sparse_nonnegative,
    projected_potentials,
)

__all__ = ["AIHTResult", "aiht", "coreset_objective", "project_sparse_nonnegative", "projected_potentials"]
