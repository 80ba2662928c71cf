"""Bayesian tools: :mod:`sidejax.bayes.coresets` (sparse non-negative coreset weights by Accelerated IHT),
:mod:`sidejax.bayes.variational` (mean-field Gaussian posteriors over any model's parameters) and
:mod:`sidejax.bayes.inference` (HMC and SGLD through blackjax, with divergences reported) and
:mod:`sidejax.bayes.pseudocoresets` (BPC-fKL's forward-KL gradient, the initialisation and the
server's aggregation of pseudocoresets)."""

from sidejax.bayes import coresets, inference, pseudocoresets, variational
from sidejax.bayes.coresets import *
from sidejax.bayes.inference import *
from sidejax.bayes.pseudocoresets import *
from sidejax.bayes.variational import *

# every submodule's public names (its __all__), declared once there
__all__ = [*coresets.__all__, *inference.__all__, *pseudocoresets.__all__, *variational.__all__]
