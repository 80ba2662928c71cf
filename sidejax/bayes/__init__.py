"""Bayesian tools: :mod:`sidejax.bayes.coresets` (sparse non-negative coreset weights by Accelerated IHT),
:mod:`sidejax.bayes.variational` (mean-field Gaussian posteriors over any model's parameters) and
:mod:`sidejax.bayes.inference` (HMC and SGLD through blackjax, with divergences reported) and
:mod:`sidejax.bayes.pseudocoresets` (BPC-fKL's forward-KL gradient, the initialisation and the
server's aggregation of pseudocoresets)."""

from sidejax.bayes.coresets import (
    AIHTResult,
    aiht,
    coreset_objective,
    project_sparse_nonnegative,
    projected_potentials,
)
from sidejax.bayes.inference import (
    DivergenceWarning,
    HMCResult,
    MAPResult,
    SGLDResult,
    check_divergences,
    hmc,
    map_estimate,
    sgld,
)
from sidejax.bayes.pseudocoresets import (
    FKLGradient,
    Pseudocoreset,
    aggregate_pseudocoresets,
    coreset_logdensity,
    cycled_labels,
    expert_trajectories,
    fkl_gradient,
    fkl_surrogate,
    init_pseudocoreset,
    inner_chain,
    learn_pseudocoreset,
    trajectory_pairs,
)
from sidejax.bayes.variational import (
    MeanField,
    diag_gaussian_kl,
    init_mean_field,
    mean_field_kl,
    sample,
    scales,
)

__all__ = [
    "AIHTResult",
    "aiht",
    "coreset_objective",
    "project_sparse_nonnegative",
    "projected_potentials",
    "MeanField",
    "diag_gaussian_kl",
    "init_mean_field",
    "mean_field_kl",
    "sample",
    "scales",
    "DivergenceWarning",
    "check_divergences",
    "HMCResult",
    "SGLDResult",
    "hmc",
    "sgld",
    "MAPResult",
    "map_estimate",
    "FKLGradient",
    "fkl_gradient",
    "fkl_surrogate",
    "inner_chain",
    "Pseudocoreset",
    "aggregate_pseudocoresets",
    "coreset_logdensity",
    "cycled_labels",
    "init_pseudocoreset",
    "learn_pseudocoreset",
    "trajectory_pairs",
    "expert_trajectories",
]
