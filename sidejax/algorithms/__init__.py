"""Compressed and Bayesian federated algorithms built on the round engine (one module per method).

- :func:`fedpm`: FedPM and FedPM-KLMS (probability masks over a frozen random network).
- :func:`qsgd`: QSGD and QSGD-KLMS.
- :func:`signsgd`: (stochastic) SignSGD and SignSGD-KLMS.
- :func:`langevin`: QLSD and SGLD-KLMS (Bayesian FL).
- :func:`distributed_mean`: the KLMS paper's App. F toy; :func:`theorem41_epsilon`, the Thm 4.1 bound.
"""

from sidejax.algorithms.common import (
    FlatLayout,
    elias_gamma_bits,
    enumerative_mask_bits,
    flat_layout,
)
from sidejax.algorithms.fedpm import (
    FedPMState,
    bayes_agg,
    bernoulli_mask,
    fedpm,
    masked_network,
    signed_constant_init,
)
from sidejax.algorithms.langevin import LangevinState, langevin, sgld_klms_sigma
from sidejax.algorithms.qsgd import (
    QSGDState,
    qsgd,
    qsgd_dequantize,
    qsgd_elias_bound_bits,
    qsgd_quantize,
    qsgd_symbol_probs,
)
from sidejax.algorithms.signsgd import SignSGDState, signsgd, stochastic_sign_probs
from sidejax.algorithms.toy import (
    distributed_mean,
    gaussian_log_ratio_tail,
    log2_candidates_for_overhead,
    theorem41_epsilon,
)

__all__ = [
    "FlatLayout",
    "elias_gamma_bits",
    "enumerative_mask_bits",
    "flat_layout",
    "FedPMState",
    "bayes_agg",
    "bernoulli_mask",
    "fedpm",
    "masked_network",
    "signed_constant_init",
    "LangevinState",
    "langevin",
    "sgld_klms_sigma",
    "QSGDState",
    "qsgd",
    "qsgd_dequantize",
    "qsgd_elias_bound_bits",
    "qsgd_quantize",
    "qsgd_symbol_probs",
    "SignSGDState",
    "signsgd",
    "stochastic_sign_probs",
    "distributed_mean",
    "gaussian_log_ratio_tail",
    "theorem41_epsilon",
    "log2_candidates_for_overhead",
]
