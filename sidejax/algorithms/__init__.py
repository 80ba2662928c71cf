"""Federated algorithms on the round engine, one module per method; each takes a ``coder=``.

- :func:`fedavg`: FedAvg / FedOpt (float32 uplink by default).
- :func:`fedpa`: FedPA, federated posterior averaging (FedAvg for the burn-in rounds, then the clients'
  shrinkage-covariance deltas from local IASG samples, :func:`fedpa_delta`).
- :func:`fedpm`: FedPM (Golomb-coded mask) and FedPM-KLMS (``coder=klms_coder(...)``).
- :func:`qsgd`: QSGD (Elias stream) and QSGD-KLMS.
- :func:`signsgd`: (stochastic) SignSGD and SignSGD-KLMS.
- :func:`qlsd`, :func:`sgld`: Bayesian FL with Langevin dynamics (QLSD; SGLD-KLMS).
- :func:`bicompfl_gr`, :func:`bicompfl_gr_reconst`, :func:`bicompfl_pr`: BICompFL, bi-directional
  importance-sampled compression of a FedPM model (GR, GR-Reconst-Fixed, PR, PR-Fixed-SplitDL);
  :func:`bicompfl_downlink`, the importance-sampled downlink coder (CRC-32 on by default).
- :func:`memsgd`, :func:`doublesqueeze`, :func:`neolithic`, :func:`cser`: the non-stochastic
  bi-directionally compressed baselines (error feedback, scaled-sign compressor); :func:`liec` (local
  immediate error compensation, float32 averaging every ``period`` rounds) and :func:`m3` (MARINA-P's
  permutation-compressed downlink, TopK uplink with EF21 and momentum), the BICompFL paper's other two.
- :func:`cepam`: CEPAM's FedAvg around a privacy mechanism coder (LRSUQ, additive noise, SDQ), with
  per-client noise levels.
- :func:`pfedbayes`, :func:`pfedbayes_subset`, :func:`coreset_pfedbayes`: personalized variational Bayesian
  FL (pFedBayes), its RandomSubset baseline, and CoreSet-PFedBayes (A-IHT coreset weights per client).
- :func:`pfedme`, :func:`perfedavg`: the personalized baselines of CoreSet-PFedBayes' tables, pFedMe (Moreau
  envelopes) and Per-FedAvg (one-step MAML, first-order or Hessian-free), on FedAvg's downlink and server.
- :func:`bpcfl`: BPC-FL, one-shot Bayesian FL with function-space pseudocoresets (one upload per client,
  then MAP / HMC / SGLD on the aggregated pseudocoreset: :func:`map_inference`, :func:`hmc_inference`,
  :func:`sgld_inference`).
- :func:`dosfl`: DOSFL, distilled one-shot FL (BPC-FL's baseline): each client uploads distilled data
  once, the server replays it.
- :mod:`sidejax.algorithms.dense`: the shared "train, code the update, average, server step" skeleton.
- :mod:`sidejax.algorithms.mirror`: mirror descent with the negative binary entropy on mask scores
  (BICompFL App. B): :func:`mirror_descent` (an Optax transformation), :func:`kl_prox_step`.
"""

from sidejax.algorithms.bicompfl import (
    bicompfl_downlink,
    bicompfl_gr,
    bicompfl_gr_reconst,
    bicompfl_pr,
    fixed_rates,
)
from sidejax.algorithms.bpcfl import (
    BPCFLServer,
    BPCFLSettings,
    Inference,
    InferenceResult,
    bpcfl,
    check_client_sizes,
    hmc_inference,
    map_inference,
    sgld_inference,
    uplink_floats,
)
from sidejax.algorithms.cepam import CepamClient, CepamServer, cepam, sampled_sgd
from sidejax.algorithms.compressed import (
    CompressedClientState,
    CompressedServerInfo,
    CompressedState,
    ErrorFeedbackMethod,
    cser,
    doublesqueeze,
    memsgd,
    neolithic,
)
from sidejax.algorithms.dense import (
    DenseClientExtra,
    DenseMethod,
    DenseServerInfo,
    DenseState,
    coder_metrics,
    dense_algorithm,
)
from sidejax.algorithms.dosfl import Distilled, DOSFLServer, DOSFLSettings, dosfl
from sidejax.algorithms.fedavg import FedAvgServerInfo, FedAvgState, fedavg, weighted_mean
from sidejax.algorithms.fedpa import FedPASettings, FedPAState, fedpa, fedpa_delta
from sidejax.algorithms.fedpm import (
    FedPMState,
    bayes_agg,
    bernoulli_mask,
    fedpm,
    masked_network,
    signed_constant_init,
)
from sidejax.algorithms.langevin import (
    LangevinSettings,
    minibatch_potential_grad,
    qlsd,
    sgld,
    sgld_klms_sigma,
)
from sidejax.algorithms.liec import liec
from sidejax.algorithms.m3 import M3ClientState, M3State, m3
from sidejax.algorithms.mirror import (
    bregman_divergence,
    kl_prox_step,
    mirror_descent,
    neg_entropy,
)
from sidejax.algorithms.perfedavg import PerFedAvgSettings, perfedavg
from sidejax.algorithms.pfedbayes import (
    CoresetSettings,
    PFedBayesSettings,
    coreset_pfedbayes,
    pfedbayes,
    pfedbayes_subset,
)
from sidejax.algorithms.pfedme import PFedMeSettings, pfedme
from sidejax.algorithms.qsgd import (
    QSGDPrior,
    qsgd,
    qsgd_dequantize,
    qsgd_elias_bound_bits,
    qsgd_law,
    qsgd_quantize,
)
from sidejax.algorithms.signsgd import sign_law, signsgd, stochastic_sign_probs

__all__ = [
    "bpcfl",
    "BPCFLSettings",
    "BPCFLServer",
    "Inference",
    "InferenceResult",
    "map_inference",
    "hmc_inference",
    "sgld_inference",
    "check_client_sizes",
    "uplink_floats",
    "pfedbayes",
    "pfedbayes_subset",
    "coreset_pfedbayes",
    "PFedBayesSettings",
    "CoresetSettings",
    "pfedme",
    "PFedMeSettings",
    "perfedavg",
    "PerFedAvgSettings",
    "cepam",
    "sampled_sgd",
    "CepamServer",
    "CepamClient",
    "bicompfl_downlink",
    "bicompfl_gr",
    "bicompfl_gr_reconst",
    "bicompfl_pr",
    "fixed_rates",
    "CompressedClientState",
    "CompressedServerInfo",
    "CompressedState",
    "ErrorFeedbackMethod",
    "cser",
    "doublesqueeze",
    "memsgd",
    "neolithic",
    "DenseClientExtra",
    "DenseMethod",
    "DenseServerInfo",
    "DenseState",
    "coder_metrics",
    "dense_algorithm",
    "FedAvgServerInfo",
    "FedAvgState",
    "fedavg",
    "weighted_mean",
    "FedPASettings",
    "FedPAState",
    "fedpa",
    "fedpa_delta",
    "FedPMState",
    "bayes_agg",
    "bernoulli_mask",
    "fedpm",
    "masked_network",
    "signed_constant_init",
    "LangevinSettings",
    "minibatch_potential_grad",
    "qlsd",
    "sgld",
    "sgld_klms_sigma",
    "liec",
    "M3ClientState",
    "M3State",
    "m3",
    "bregman_divergence",
    "kl_prox_step",
    "mirror_descent",
    "neg_entropy",
    "QSGDPrior",
    "qsgd",
    "qsgd_dequantize",
    "qsgd_elias_bound_bits",
    "qsgd_law",
    "qsgd_quantize",
    "sign_law",
    "signsgd",
    "stochastic_sign_probs",
    "dosfl",
    "DOSFLSettings",
    "DOSFLServer",
    "Distilled",
]
