"""sidejax: a JAX-first functional library for communication-efficient and Bayesian federated learning.

Subpackages: :mod:`sidejax.data` (datasets, partitions, FederatedData), :mod:`sidejax.models` (Flax models
of the papers), :mod:`sidejax.fl` (round engine, local training, evaluation), :mod:`sidejax.algorithms`
(FedAvg, FedPM, QSGD, SignSGD, QLSD/SGLD, each with a ``coder=``), :mod:`sidejax.coding` (the Coder
contract and coders), :mod:`sidejax.keys` (the key schedule), :mod:`sidejax.bits` (code lengths),
:mod:`sidejax.layout` (flat parameter layouts), :mod:`sidejax.metrics` (accuracy, NLL, ECE, predictive
averaging), :mod:`sidejax.lattices` (Z^n, A2, D4, E8 with nearest-point search), :mod:`sidejax.privacy`
(CEPAM's (epsilon, delta) accountant).
"""

from sidejax import (
    algorithms,
    bits,
    blocks,
    coding,
    data,
    distributions,
    fl,
    keys,
    lattices,
    layout,
    metrics,
    models,
    privacy,
)

__version__ = "0.1.0"

__all__ = [
    "algorithms",
    "layout",
    "metrics",
    "bits",
    "blocks",
    "coding",
    "data",
    "distributions",
    "fl",
    "keys",
    "lattices",
    "models",
    "privacy",
    "__version__",
]
