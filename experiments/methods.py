"""The ``[method]`` table: one typed config per federated method of :mod:`sidejax.algorithms`.

Each config has exactly the fields its method uses (a field another method has is an error, not silently
ignored), declares the coders it accepts (``[coder] name``, :mod:`experiments.coders`) and its default
coder, and builds the :class:`sidejax.fl.Algorithm` with :meth:`MethodConfig.build`. The field defaults are
the tuned values of the reduced-scale Fashion-MNIST presets (``experiments/presets/klms_fmnist_*.toml``):
with plainer ones some methods barely learn (5 rounds on digits: SignSGD 7.8%, QSGD-KLMS 9.7%).

The nine algorithm names of the tables and plots are shortcuts for (method, coder) pairs
(:data:`SHORTCUTS`); other pairs are named ``method+coder`` (:func:`algorithm_name`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import optax

import sidejax.algorithms
from experiments.coders import CODERS, CoderConfig, MechanismConfig
from experiments.sections import Section, by_name, choice, fills
from sidejax.algorithms import (
    BPCFLSettings,
    DOSFLSettings,
    FedPASettings,
    LangevinSettings,
    bicompfl_downlink,
    bpcfl,
    check_client_sizes,
    dosfl,
    hmc_inference,
    map_inference,
    sgld_inference,
)
from sidejax.algorithms.bpcfl import check_settings
from sidejax.algorithms.dosfl import check_dosfl_settings
from sidejax.algorithms.fedpa import SHRINKAGE_FORMS, check_fedpa_settings
from sidejax.algorithms.mirror import mirror_descent
from sidejax.algorithms.perfedavg import VARIANTS, PerFedAvgSettings, check_perfedavg_settings
from sidejax.algorithms.pfedbayes import KL_SCALE_MODES, CoresetSettings, PFedBayesSettings
from sidejax.algorithms.pfedme import PERSONAL_MODELS, PFedMeSettings, check_pfedme_settings
from sidejax.coding import Coder
from sidejax.fl import Algorithm, LocalTraining

__all__ = [
    "OPTIMIZERS",
    "make_optimizer",
    "Build",
    "MethodConfig",
    "LocalTrainingConfig",
    "FedAvgConfig",
    "FedPMConfig",
    "QSGDConfig",
    "SignSGDConfig",
    "LangevinConfig",
    "QLSDConfig",
    "SGLDConfig",
    "BICompFLConfig",
    "BICompFLGRConfig",
    "BICompFLReconstConfig",
    "BICompFLPRConfig",
    "ErrorFeedbackConfig",
    "MemSGDConfig",
    "DoubleSqueezeConfig",
    "NeolithicConfig",
    "PeriodicConfig",
    "CSERConfig",
    "LIECConfig",
    "M3Config",
    "CepamConfig",
    "PFedBayesConfig",
    "PFedBayesSubsetConfig",
    "CoresetPFedBayesConfig",
    "PFedMeConfig",
    "PerFedAvgConfig",
    "BPCFLConfig",
    "FedPAConfig",
    "DOSFLConfig",
    "ERROR_FEEDBACK_METHODS",
    "METHODS",
    "SHORTCUTS",
    "algorithm_name",
    "parse_algorithm",
]

OPTIMIZERS = ("sgd", "momentum", "adam")
#: the optimizers of mask scores: also App. B's mirror descent (BICompFL)
MASK_OPTIMIZERS = (*OPTIMIZERS, "mirror")


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """``sgd``, ``momentum`` (0.9), ``adam``, or (mask scores only) ``mirror``: plain SGD in logit space on
    the gradient w.r.t. the keep-probabilities (:func:`sidejax.algorithms.mirror.mirror_descent`)."""
    if name == "mirror":
        return mirror_descent(lr)
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=0.9)
    if name == "adam":
        return optax.adam(lr)
    raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {list(OPTIMIZERS)}")


# KLMS as tuned for the dense methods on Fashion-MNIST: K = 256 candidates, blocks of 5 bits of KL (r = 3),
# cap 1024, re-partition outside [3.33, 10] bits
_KLMS_TUNED = {
    "log2_num_candidates": 8,
    "overhead_bits": 3.0,
    "max_block_size": 1024,
    "dbar_min": 3.33,
    "dbar_max": 10.0,
}


class Build(NamedTuple):
    """What :meth:`MethodConfig.build` builds an algorithm from: the loss, the ``coder`` its coder config
    built (:meth:`experiments.coders.CoderConfig.checked`; for BPC-FL a factory ``coder(num_classes)``), the
    federation, that coder config, and for a method with ``needs_model`` the
    :class:`experiments.algorithms.ModelContext`."""

    loss_fn: Callable
    coder: Any
    num_clients: int
    clients_per_round: int
    coder_config: CoderConfig
    model: Any = None


@dataclass(frozen=True)
class MethodConfig(Section):
    """Base of the method configs.

    Class attributes: :attr:`name` (the ``[method]`` table's ``name``, also the name of its builder in
    :mod:`sidejax.algorithms`), :attr:`coders` (the ``[coder]`` names it accepts; the first is its
    :attr:`default_coder`), :attr:`coder_defaults` (a coder's fields as tuned for this
    method: a coder section the user starts for this method starts from them) and :attr:`run_defaults`
    (``[run]`` values of a configuration made from defaults, :func:`experiments.config.default_config`).

    Capabilities, declared (read directly by the configuration, the driver and the checks; a method
    overrides the ones that differ): :attr:`one_shot`, :attr:`needs_model`, :attr:`full_participation`,
    and the hook :meth:`check_data`. How a run is evaluated is not declared here: the built algorithm's
    ``evaluation`` (:class:`sidejax.fl.Evaluation`) says it.
    """

    table: ClassVar[str] = "method"
    name: ClassVar[str]
    coders: ClassVar[tuple[str, ...]]
    default_coder: ClassVar[str]
    coder_defaults: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    run_defaults: ClassVar[Mapping[str, Any]] = {}
    #: the method runs exactly one round, with every client (:class:`experiments.config.ExperimentConfig`
    #: refuses other ``run.rounds`` and participations): BPC-FL
    one_shot: ClassVar[bool] = False
    #: :meth:`build` also needs ``model``, an :class:`experiments.algorithms.ModelContext` (the network's
    #: initialiser, one example's input shape, the number of classes): BPC-FL
    needs_model: ClassVar[bool] = False
    #: why the method needs every client in every round (:meth:`build` refuses data.participation < 1), or
    #: ``None`` when it takes any participation
    full_participation: ClassVar[str | None] = None
    #: ``{builder parameter: library settings type this section fills}``
    library_args: ClassVar[Mapping[str, type]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "coders" in cls.__dict__:
            cls.default_coder = cls.coders[0]

    def check_data(self, client_sizes) -> None:
        """Called with every client's number of training examples before anything is built or run; raises
        ``ValueError`` for a federation the method cannot train on (default: accepts any)."""

    def check_coder(self, coder: CoderConfig) -> None:
        """Raises ``ValueError`` if this method cannot send its messages with ``coder``."""
        if coder.name not in self.coders:
            raise ValueError(
                f"{self.label()} does not take coder {coder.name!r}; its coders: {', '.join(self.coders)}"
            )

    def build(self, b: Build) -> Algorithm:
        """The :class:`sidejax.fl.Algorithm` of this method (refused when it needs
        :attr:`full_participation` and does not have it)."""
        if self.full_participation and b.clients_per_round != b.num_clients:
            raise ValueError(
                f"{self.label()} needs every client in every round, data.participation = 1 "
                f"({self.full_participation}); got {b.clients_per_round} of {b.num_clients} clients per round"
            )
        return self.algorithm(b)

    def algorithm(self, b: Build) -> Algorithm:
        """The method's algorithm (:meth:`build` after its checks): by default its builder called by
        :meth:`call`."""
        return self.call(b)

    def call(self, b: Build, **given: Any) -> Algorithm:
        """The builder ``sidejax.algorithms.<name>`` called with ``b.loss_fn`` and, for each of its other
        parameters: the value ``given``, else the federation's or coder's value (``clients_per_round``,
        ``num_clients``, ``coder``), else the library value of a type this section fills
        (:attr:`library_args`, its non-scalar fields from :meth:`extras`), else the field of the same name;
        a parameter none of these has keeps the builder's default."""
        builder = getattr(sidejax.algorithms, self.name)  # looked up at call time: tests record calls
        params = list(inspect.signature(builder).parameters)[1:]
        context = {"clients_per_round": b.clients_per_round, "num_clients": b.num_clients, "coder": b.coder}
        kwargs = {}
        for name in params:
            if name in given or name in context:
                kwargs[name] = given[name] if name in given else context[name]
            elif name in self.library_args:
                library = self.library_args[name]
                kwargs[name] = self.library_value(library, **self.extras(library))
            elif name in self.field_names():
                kwargs[name] = getattr(self, name)
        return builder(b.loss_fn, **kwargs)

    def extras(self, library: type) -> dict[str, Any]:
        """The fields of the library type ``library`` that this section carries in another form (an
        optimizer by name and learning rate): ``{library field: value}``."""
        return {}


@dataclass(frozen=True)
@fills(
    LocalTraining,
    skip=("optimizer",),
    rename={"num_epochs": "local_epochs", "num_steps": "local_steps"},
    defaults={"local_epochs": 1, "batch_size": 32},
)
class LocalTrainingConfig(MethodConfig):
    """Base of the methods whose clients train locally for some epochs or steps
    (:class:`sidejax.fl.LocalTraining`'s fields, its optimizer by name and learning rate).

    Attributes:
      local_epochs: local epochs per round (give this or local_steps: giving one in a preset or on the command
        line unsets the other).
      local_steps: local optimizer steps per round, instead of epochs.
      client_optimizer: sgd, momentum (SGD with momentum 0.9) or adam; the BICompFL methods also take mirror
        (App. B: mirror descent on the mask, plain SGD in logit space on the gradient w.r.t. theta).
      client_lr: local learning rate.
    """

    limits: ClassVar = {">= 1": "local_epochs local_steps batch_size", "> 0": "client_lr server_lr"}
    library_args: ClassVar = {"local": LocalTraining}

    client_optimizer: str = choice("momentum", OPTIMIZERS)
    client_lr: float = 0.05

    def check(self) -> None:
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ValueError(
                f"{self.label()}: give one of local_epochs and local_steps (the other unset); got "
                f"local_epochs={self.local_epochs!r}, local_steps={self.local_steps!r}"
            )

    @classmethod
    def merge(cls, base: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        merged = super().merge(base, given)
        for name, other in (("local_epochs", "local_steps"), ("local_steps", "local_epochs")):
            if given.get(name) is not None and other not in given:
                merged[other] = None
        return merged

    def extras(self, library: type) -> dict[str, Any]:
        return {"optimizer": make_optimizer(self.client_optimizer, self.client_lr)}


@dataclass(frozen=True)
class FedAvgConfig(LocalTrainingConfig):
    """FedAvg / FedOpt (:func:`sidejax.algorithms.fedavg`): the updates sent uncompressed.

    Attributes:
      server_optimizer: none (plain averaging), sgd, momentum or adam (FedOpt).
      server_lr: server learning rate (fedavg: only with a server_optimizer, which then needs it).
    """

    name: ClassVar[str] = "fedavg"
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    conditional: ClassVar = {"server_lr": ("server_optimizer", OPTIMIZERS, True)}

    server_optimizer: str = choice("none", ("none", *OPTIMIZERS))
    server_lr: float | None = None

    def algorithm(self, b: Build) -> Algorithm:
        server = None
        if self.server_optimizer != "none":
            server = make_optimizer(self.server_optimizer, self.server_lr)
        return self.call(b, server_optimizer=server)


@dataclass(frozen=True)
class FedPMConfig(LocalTrainingConfig):
    """FedPM (:func:`sidejax.algorithms.fedpm`): clients train the scores of a probability mask over frozen
    random weights and send one mask sample (``mask``: Golomb-coded; ``klms``: FedPM-KLMS). Adam 0.1 on the
    mask scores by default.

    Attributes:
      estimator: FedPM's gradient estimator through the mask sample, fedpm or ste.
    """

    name: ClassVar[str] = "fedpm"
    coders: ClassVar[tuple[str, ...]] = ("mask", "klms")
    coder_defaults: ClassVar = {"klms": _KLMS_TUNED}

    client_optimizer: str = choice("adam", OPTIMIZERS)
    client_lr: float = 0.1
    estimator: str = choice("fedpm", ("fedpm", "ste"))


@dataclass(frozen=True)
class QSGDConfig(LocalTrainingConfig):
    """QSGD (:func:`sidejax.algorithms.qsgd`): the local change quantised to ``levels`` levels per sign
    (``elias``: Elias stream; ``klms``: QSGD-KLMS against a symbol prior, which needs levels = 1).

    Attributes:
      server_lr: server learning rate (the server steps by it along the mean decoded change).
      levels: QSGD quantisation levels s.
      prior_smoothing: weight in (0, 1] of the tensor-level symbol frequencies in QSGD-KLMS's prior.
    """

    name: ClassVar[str] = "qsgd"
    coders: ClassVar[tuple[str, ...]] = ("elias", "klms")
    coder_defaults: ClassVar = {"klms": _KLMS_TUNED}
    limits: ClassVar = {">= 1": "levels", "in (0, 1]": "prior_smoothing"}

    server_lr: float = 1.0
    levels: int = 1
    prior_smoothing: float = 1.0

    def check_coder(self, coder: CoderConfig) -> None:
        super().check_coder(coder)
        if coder.name == "klms" and self.levels != 1:
            raise ValueError(
                f"{self.label()} with coder 'klms' samples against a symbol prior, which needs levels = 1 "
                f"(eq. 5); got levels={self.levels}"
            )


@dataclass(frozen=True)
class SignSGDConfig(LocalTrainingConfig):
    """(Stochastic) SignSGD (:func:`sidejax.algorithms.signsgd`): the signs of the local change (``signs``:
    one bit each; ``klms``: SignSGD-KLMS against the uniform sign prior).

    Attributes:
      server_lr: server learning rate (the server steps by it along the mean sign).
      temperature: stochastic signs use P(+1) = sigmoid(temperature * v / max|v|) per tensor.
      stochastic: stochastic signs (eq. 6) if true, deterministic sign(v) if false.
    """

    name: ClassVar[str] = "signsgd"
    coders: ClassVar[tuple[str, ...]] = ("signs", "klms")
    coder_defaults: ClassVar = {"klms": _KLMS_TUNED}

    limits: ClassVar = {"> 0": "temperature"}

    server_lr: float = 0.02
    temperature: float = 20.0
    stochastic: bool = True


@dataclass(frozen=True)
@fills(LangevinSettings)
class LangevinConfig(MethodConfig):
    """Base of the Langevin methods (:class:`sidejax.algorithms.LangevinSettings`'s fields): one minibatch
    gradient of the potential per client and round (the reference code's MNIST values: batch 64, gamma
    1e-5, weight decay 5, 200 rounds evaluated every 20). The potential sums over the client's data, so the
    effective step grows with the dataset: on the 1,437-example digits gamma 1e-5 is slow (60-66% after 200
    rounds); demo_digits_{qlsd,sgld_klms} use 1e-4."""

    run_defaults: ClassVar = {"rounds": 200, "eval_every": 20}
    library_args: ClassVar = {"settings": LangevinSettings}
    limits: ClassVar = {">= 1": "batch_size levels", "> 0": "step_size", ">= 0": "weight_decay"}


@dataclass(frozen=True)
class QLSDConfig(LangevinConfig):
    """QLSD (:func:`sidejax.algorithms.qlsd`): QSGD-quantised potential gradients (Elias stream), Langevin
    noise added by the server.

    Attributes:
      levels: QSGD quantisation levels s of the gradients.
    """

    name: ClassVar[str] = "qlsd"
    coders: ClassVar[tuple[str, ...]] = ("elias",)

    levels: int = 5


@dataclass(frozen=True)
class SGLDConfig(LangevinConfig):
    """Federated SGLD (:func:`sidejax.algorithms.sgld`): each client sends one sample of a Gaussian around
    its potential gradient (``klms``: SGLD-KLMS, with K = 4 and MAX_BLOCK_SIZE 16 as the reference code;
    ``float32``: the sample uncompressed)."""

    name: ClassVar[str] = "sgld"
    coders: ClassVar[tuple[str, ...]] = ("klms", "float32")
    coder_defaults: ClassVar = {"klms": {"log2_num_candidates": 2, "max_block_size": 16}}


# --- the non-stochastic error-feedback baselines of the BICompFL paper (sidejax.algorithms.compressed) ---

_BROADCASTS = "it broadcasts compressed model changes, which a client that misses a round cannot follow"


@dataclass(frozen=True)
class ErrorFeedbackConfig(LocalTrainingConfig):
    """Base of the error-feedback baselines (:mod:`sidejax.algorithms.compressed`): the deterministic scaled
    sign (``scaled_sign``; ``float32``: error feedback without compression). The defaults are the BICompFL
    paper's settings: Adam 3e-4 for 3 epochs of batches of 128, server learning rate 0.1.

    Attributes:
      server_lr: server learning rate eta_S (its step along the mean decoded change).
    """

    coders: ClassVar[tuple[str, ...]] = ("scaled_sign", "float32")

    local_epochs: int | None = 3
    batch_size: int = 128
    client_optimizer: str = choice("adam", OPTIMIZERS)
    client_lr: float = 3e-4
    server_lr: float = 0.1


@dataclass(frozen=True)
class MemSGDConfig(ErrorFeedbackConfig):
    """Mem-SGD (:func:`sidejax.algorithms.memsgd`): client error feedback, compressed uplink, float32 model
    downlink."""

    name: ClassVar[str] = "memsgd"


@dataclass(frozen=True)
class DoubleSqueezeConfig(ErrorFeedbackConfig):
    """DoubleSqueeze (:func:`sidejax.algorithms.doublesqueeze`): error-compensated compression on the
    clients and on the server (needs every client in every round)."""

    name: ClassVar[str] = "doublesqueeze"
    full_participation: ClassVar = _BROADCASTS


@dataclass(frozen=True)
class NeolithicConfig(ErrorFeedbackConfig):
    """Neolithic (:func:`sidejax.algorithms.neolithic`): DoubleSqueeze with compress_rounds rounds of
    compressing the residual, both ways (needs every client in every round).

    Attributes:
      compress_rounds: rounds R of compressing the residual, C(v) + C(v - C(v)) + ... (R messages each way).
    """

    name: ClassVar[str] = "neolithic"
    full_participation: ClassVar = _BROADCASTS

    limits: ClassVar = {">= 1": "compress_rounds"}

    compress_rounds: int = 2


@dataclass(frozen=True)
class PeriodicConfig(ErrorFeedbackConfig):
    """Base of the error-feedback baselines that do something every period rounds (CSER, LIEC).

    Attributes:
      period: rounds between CSER's error resets, or between LIEC's full-precision averagings.
    """

    limits: ClassVar = {">= 1": "period"}

    period: int = 50


@dataclass(frozen=True)
class CSERConfig(PeriodicConfig):
    """CSER (:func:`sidejax.algorithms.cser`): the residual stays in each client's model, with a compressed
    error reset every period rounds; float32 model downlink."""

    name: ClassVar[str] = "cser"


ERROR_FEEDBACK_METHODS = (MemSGDConfig, DoubleSqueezeConfig, NeolithicConfig, CSERConfig)


@dataclass(frozen=True)
class LIECConfig(PeriodicConfig):
    """LIEC (:func:`sidejax.algorithms.liec`): local immediate error compensation, compressed both ways, with
    a float32 averaging every period rounds (needs every client in every round)."""

    name: ClassVar[str] = "liec"
    full_participation: ClassVar = _BROADCASTS


@dataclass(frozen=True)
class M3Config(ErrorFeedbackConfig):
    """M3 (:func:`sidejax.algorithms.m3`): MARINA-P's permutation-compressed downlink with random float32
    syncs, the uplink compressed (``topk``: TopK, K = floor(d/n) by default) with EF21 error feedback and
    momentum (needs every client in every round). Server learning rate 0.02 [P].

    Attributes:
      momentum: the momentum weight beta in (0, 1] of z = (1 - beta) z + beta Delta (1: plain EF21).
      sync_probability: the probability p in (0, 1] of a float32 sync downlink (unset: 1/n).
    """

    name: ClassVar[str] = "m3"
    coders: ClassVar[tuple[str, ...]] = ("topk", "scaled_sign", "float32")
    full_participation: ClassVar = "it sends every client its own part of the model's change"

    limits: ClassVar = {"in (0, 1]": "momentum sync_probability"}

    server_lr: float = 0.02
    momentum: float = 0.1
    sync_probability: float | None = None

    def algorithm(self, b: Build) -> Algorithm:
        """``b.coder``: a coder, or the ``topk`` factory ``coder(num_clients)`` (K = floor(d/n) unless its
        divisor is set)."""
        coder = b.coder if isinstance(b.coder, Coder) else b.coder(b.clients_per_round)
        return self.call(b, coder=coder)


# --- end of the error-feedback baselines ---


@dataclass(frozen=True)
class CepamConfig(MethodConfig):
    """CEPAM's FedAvg (:func:`sidejax.algorithms.cepam`): tau single-sample steps drawn with replacement,
    SGD with momentum, the update sent through a privacy mechanism (``lrsuq``: CEPAM; ``noise``: FL+Gaussian
    / FL+Laplace, with SDQ if its sdq_step > 0; ``sdq``: FL+SDQ; ``float32``: FL). Defaults: the paper's
    (docs/papers/cepam.md#s3). The noise levels, one or one per client, are the coder's ``level``
    (:class:`experiments.coders.MechanismConfig`), the one place the algorithm and the accountant read them.

    Attributes:
      local_steps: tau, local steps per round.
      batch_size: examples per step (with replacement).
      client_lr: the clients' learning rate (constant; the paper halves it on a 10-round validation plateau).
      momentum: SGD momentum (0: plain SGD).
      persistent_momentum: keep each client's momentum buffer across rounds (the reference code).
    """

    name: ClassVar[str] = "cepam"
    coders: ClassVar[tuple[str, ...]] = ("lrsuq", "noise", "sdq", "float32")
    run_defaults: ClassVar = {"rounds": 80, "eval_every": 5}
    limits: ClassVar = {">= 1": "local_steps batch_size", "> 0": "client_lr", "in [0, 1)": "momentum"}

    local_steps: int = 15
    batch_size: int = 1
    client_lr: float = 0.01
    momentum: float = 0.9
    persistent_momentum: bool = True

    def algorithm(self, b: Build) -> Algorithm:
        mechanism = isinstance(b.coder_config, MechanismConfig)
        return self.call(
            b,
            optimizer=optax.sgd(self.client_lr, momentum=self.momentum or None),
            noise_levels=b.coder_config.client_levels(b.num_clients) if mechanism else None,
            persistent_optimizer=self.persistent_momentum,
        )


@dataclass(frozen=True)
@fills(
    PFedBayesSettings,
    skip=("personal_optimizer", "global_optimizer"),
    choices={"kl_scale_mode": KL_SCALE_MODES},
)
class PFedBayesConfig(MethodConfig):
    """pFedBayes (:func:`sidejax.algorithms.pfedbayes`): personal and localized-global mean-field posteriors
    trained by Eq. 9, the server averaging the clients' localized globals
    (:class:`sidejax.algorithms.pfedbayes.PFedBayesSettings`'s fields, Adam for both tracks). Defaults:
    docs/papers/coreset_pfedbayes.md#s3-1 (the reference code's Adam 1e-3, zeta 10, R = 20, R_p = 5,
    b = 100).

    Attributes:
      personal_lr: Adam learning rate of the personal posteriors (eta_1).
      global_lr: Adam learning rate of the localized global copies (eta_2).
    """

    name: ClassVar[str] = "pfedbayes"
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    run_defaults: ClassVar = {"rounds": 60, "eval_every": 5}
    library_args: ClassVar = {"settings": PFedBayesSettings}
    limits: ClassVar = {
        ">= 1": "local_iters personal_steps batch_size mc_samples subset_size",
        "> 0": "zeta eps_std personal_lr global_lr init_weight_scale",
        "in (0, 1]": "beta",
    }

    personal_lr: float = 1e-3
    global_lr: float = 1e-3

    def extras(self, library: type) -> dict[str, Any]:
        if library is not PFedBayesSettings:
            return {}
        return {
            "personal_optimizer": optax.adam(self.personal_lr),
            "global_optimizer": optax.adam(self.global_lr),
        }


@dataclass(frozen=True)
class PFedBayesSubsetConfig(PFedBayesConfig):
    """The RandomSubset baseline (:func:`sidejax.algorithms.pfedbayes_subset`): pFedBayes on a fixed uniformly
    random subset of every client's data.

    Attributes:
      subset_size: points per client in the subset (the paper: 50% of 1,000).
      reweight: weight the subset's points n/k (the full data's likelihood mass) instead of 1 (the paper's).
    """

    name: ClassVar[str] = "pfedbayes_subset"

    subset_size: int = 500
    reweight: bool = False


@dataclass(frozen=True)
@fills(
    CoresetSettings,
    rename={
        "every": "coreset_every",
        "max_iter": "aiht_max_iter",
        "tol": "aiht_tol",
        "step_scale": "aiht_step_scale",
        "debias": "aiht_debias",
        "init": "coreset_init",
    },
    defaults={"coreset_every": 10},
    choices={"coreset_init": ("random", "zeros")},
)
class CoresetPFedBayesConfig(PFedBayesConfig):
    """CoreSet-PFedBayes (:func:`sidejax.algorithms.coreset_pfedbayes`): a full-data and a coreset track per
    client, coreset weights by A-IHT from Monte-Carlo projections of the full-data posterior
    (:class:`sidejax.algorithms.pfedbayes.CoresetSettings`'s fields, A-IHT's prefixed ``aiht_``).

    Attributes:
      coreset_size: k, points per client in the coreset (the paper: 50/30/15/10% of 1,000).
      coreset_every: recompute the weights every this many rounds (1: the paper; more bounds the J x n
        forward passes).
    """

    name: ClassVar[str] = "coreset_pfedbayes"
    library_args: ClassVar = {"settings": PFedBayesSettings, "coreset": CoresetSettings}

    limits: ClassVar = {
        ">= 1": "coreset_size coreset_every aiht_max_iter",
        ">= 0": "aiht_tol",
        "in (0, 1]": "aiht_step_scale",
    }

    coreset_size: int = 500

    def check(self) -> None:
        self.require(
            self.projection_samples is None or self.projection_samples > self.coreset_size,
            "projection_samples",
            "must exceed coreset_size (or be unset: max(100, 2 coreset_size))",
        )


@dataclass(frozen=True)
@fills(PFedMeSettings, choices={"personal": PERSONAL_MODELS})
class PFedMeConfig(MethodConfig):
    """pFedMe (:func:`sidejax.algorithms.pfedme`): each client's personal model is the proximal point of its
    loss around its local model (K gradient steps at personal_lr), the local model steps on the Moreau
    envelope (lr times lam), the server mixes by beta (:class:`sidejax.algorithms.PFedMeSettings`'s fields).
    Defaults: pFedMe's own settings, the CoreSet-PFedBayes tables' baseline
    (docs/papers/coreset_pfedbayes.md#r-baselines)."""

    name: ClassVar[str] = "pfedme"
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    library_args: ClassVar = {"settings": PFedMeSettings}

    def check(self) -> None:
        self.relabel(check_pfedme_settings, self.library_value(PFedMeSettings))


@dataclass(frozen=True)
@fills(PerFedAvgSettings, choices={"variant": VARIANTS})
class PerFedAvgConfig(MethodConfig):
    """Per-FedAvg (:func:`sidejax.algorithms.perfedavg`): local MAML meta-steps (fo: first order, the pFedMe
    code's; hf: with the exact Hessian-vector product), the personal model one gradient step at alpha from
    the received model (:class:`sidejax.algorithms.PerFedAvgSettings`'s fields). Defaults: the pFedMe code's
    Per-FedAvg, the CoreSet-PFedBayes tables' baseline (docs/papers/coreset_pfedbayes.md#r-baselines)."""

    name: ClassVar[str] = "perfedavg"
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    library_args: ClassVar = {"settings": PerFedAvgSettings}

    def check(self) -> None:
        self.relabel(check_perfedavg_settings, self.library_value(PerFedAvgSettings))


# BICompFL's uplink as the CPU profile of docs/papers/bicompfl.md#s2-3: Fixed blocks of 128 with 16
# candidates, 1/32 bit per parameter
_BICOMPFL_FIXED = {"adaptive": False, "block_size": 128, "log2_num_candidates": 4}


@dataclass(frozen=True)
class BICompFLConfig(LocalTrainingConfig):
    """Base of the BICompFL methods (:mod:`sidejax.algorithms.bicompfl`): FedPM mask training (Adam 0.1 on the
    scores, 3 local epochs of batch 128 [P]; ``mirror`` for App. B's mirror descent) and ``n_UL`` uplink
    samples coded with ``[coder]`` (``klms``: Fixed or Adaptive blocks; ``klms_avg``: Adaptive-Avg)
    against the receiver's prior.

    Attributes:
      estimator: the mask gradient, fedpm (FedPM's rule) or ste.
      num_uplink_samples: n_UL, IS samples per client per round.
    """

    coders: ClassVar[tuple[str, ...]] = ("klms", "klms_avg")
    coder_defaults: ClassVar = {"klms": _BICOMPFL_FIXED}
    limits: ClassVar = {">= 1": "num_uplink_samples downlink_block_size num_downlink_samples"}

    local_epochs: int | None = 3
    batch_size: int = 128
    client_optimizer: str = choice("adam", MASK_OPTIMIZERS)
    client_lr: float = 0.1
    estimator: str = choice("fedpm", ("fedpm", "ste"))
    num_uplink_samples: int = 1


_BICOMPFL_FULL = "the paper: partial participation is incompatible with it"


@dataclass(frozen=True)
class BICompFLGRConfig(BICompFLConfig):
    """BICompFL-GR (:func:`sidejax.algorithms.bicompfl_gr`): global shared randomness; the federator relays
    the clients' uplink streams and every client rebuilds the global model (Fixed, Adaptive, Adaptive-Avg
    by the coder)."""

    name: ClassVar[str] = "bicompfl_gr"
    full_participation: ClassVar = _BICOMPFL_FULL


@dataclass(frozen=True)
class _DownlinkConfig(BICompFLConfig):
    """Base of the variants with an importance-sampled downlink (Fixed blocks).

    Attributes:
      downlink_block_size: b of the downlink's fixed blocks.
      downlink_num_candidates: n_IS of the downlink (a power of two).
      num_downlink_samples: n_DL (unset: n * n_UL, the paper's choice).
      downlink_crc32: end every downlink sample with a CRC-32 that covers the prior, so a party whose
        estimate is out of sync is reported (+32 bits per sample); the paper's bit counts carry none.
    """

    downlink_block_size: int = 128
    downlink_num_candidates: int = 16
    num_downlink_samples: int | None = None
    downlink_crc32: bool = True

    def check(self) -> None:
        k = self.downlink_num_candidates
        self.require(
            k >= 1 and k & (k - 1) == 0,
            "downlink_num_candidates",
            "must be a power of two (n_IS = 2^(bits per block index))",
        )

    def algorithm(self, b: Build) -> Algorithm:
        log2k = self.downlink_num_candidates.bit_length() - 1
        downlink = bicompfl_downlink(self.downlink_block_size, log2k, crc32=self.downlink_crc32)
        return self.call(b, downlink=downlink)


@dataclass(frozen=True)
class BICompFLReconstConfig(_DownlinkConfig):
    """BICompFL-GR-Reconst-Fixed (:func:`sidejax.algorithms.bicompfl_gr_reconst`): the federator
    reconstructs the model and broadcasts n_DL importance samples of it."""

    name: ClassVar[str] = "bicompfl_gr_reconst"
    full_participation: ClassVar = _BICOMPFL_FULL


@dataclass(frozen=True)
class BICompFLPRConfig(_DownlinkConfig):
    """BICompFL-PR and PR-Fixed-SplitDL (:func:`sidejax.algorithms.bicompfl_pr`): private shared randomness;
    per-client importance-sampled downlinks.

    Attributes:
      split_downlink: PR-Fixed-SplitDL: each client refreshes one rotating group of blocks per round.
      split_rounds: with split_downlink, the hybrid: only the downlinks of rounds t < split_rounds are
        split, the later ones are PR's full downlink (unset: every round is split).
    """

    name: ClassVar[str] = "bicompfl_pr"
    limits: ClassVar = {">= 1": "split_rounds"}
    split_downlink: bool = False
    split_rounds: int | None = None

    def check(self) -> None:
        super().check()
        self.require(
            self.split_rounds is None or self.split_downlink,
            "split_rounds",
            "sets the rounds of a split downlink, which needs split_downlink = true",
        )


@dataclass(frozen=True)
@fills(FedPASettings, choices={"shrinkage_form": SHRINKAGE_FORMS})
class FedPAConfig(MethodConfig):
    """FedPA, federated posterior averaging (:func:`sidejax.algorithms.fedpa`): FedAvg for the burn-in rounds,
    then each client sends Δ = Σ̂⁻¹(x − μ̂) from its local samples (shrinkage covariance Σ̂ = ρI + (1 − ρ)Ŝ;
    :class:`sidejax.algorithms.FedPASettings`'s fields). Defaults: the BPC-FL paper's Table 5 (EMNIST-62)
    with ℓ = 10 one-step windows (its "10 local steps"); batch 20 is not in Table 5 ([R], the recommendation
    for the FedAvg baseline, Reddi et al.; docs/papers/bpcfl.md#dep-fedpa).

    Attributes:
      batch_size: local minibatch size.
      client_optimizer: sgd, momentum (SGD with momentum 0.9) or adam.
      client_lr: local learning rate.
      server_optimizer: the server optimizer on the mean pseudo-gradient: sgd, momentum (0.9) or adam.
      server_lr: server learning rate.
    """

    name: ClassVar[str] = "fedpa"
    library_args: ClassVar = {"settings": FedPASettings}
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    limits: ClassVar = {">= 1": "batch_size", "> 0": "client_lr server_lr"}

    batch_size: int = 20
    client_optimizer: str = choice("momentum", OPTIMIZERS)
    client_lr: float = 0.01
    server_optimizer: str = choice("momentum", OPTIMIZERS)
    server_lr: float = 0.5

    def settings(self) -> FedPASettings:
        """The :class:`sidejax.algorithms.FedPASettings` of these fields."""
        return self.library_value(FedPASettings)

    def check(self) -> None:
        self.relabel(check_fedpa_settings, self.settings())

    def algorithm(self, b: Build) -> Algorithm:
        return self.call(
            b,
            client_optimizer=make_optimizer(self.client_optimizer, self.client_lr),
            server_optimizer=make_optimizer(self.server_optimizer, self.server_lr),
        )


@dataclass(frozen=True)
class OneShotMethodConfig(MethodConfig):
    """Base of the one-shot methods (BPC-FL, DOSFL): one round in which every client uploads once, built from
    the network's initialisation and input shapes (:class:`experiments.algorithms.ModelContext`)."""

    run_defaults: ClassVar = {"rounds": 1, "eval_every": 1}
    one_shot: ClassVar[bool] = True
    needs_model: ClassVar[bool] = True
    full_participation: ClassVar = "one-shot: every client uploads once"


@dataclass(frozen=True)
@fills(
    BPCFLSettings,
    skip=("num_classes", "step_size_labels", "save_interval", "pretrain_optimizer", "chain_optimizer"),
    defaults={
        "num_points": 5,
        "prior_precision": 0.1,
        "init_std": 0.6,
        "num_updates": 700,
        "step_size_inputs": 1e-3,
        "pairs_per_update": 20,
        "num_noise": 10,
        "noise_std": 1e-2,
        "num_trajectories": 100,
        "pretrain_steps": 400,
        "pretrain_batch_size": None,
        "data_chain_length": 150,
        "coreset_chain_length": 200,
    },
)
class BPCFLConfig(OneShotMethodConfig):
    """BPC-FL (:func:`sidejax.algorithms.bpcfl`): one round in which every client uploads a learned
    pseudocoreset, then downstream inference on the server (:class:`sidejax.algorithms.BPCFLSettings`'s
    fields, for classification; the optimizers by name and learning rate). Defaults: the paper's 2-D moons
    column (docs/papers/bpcfl.md#table-2, docs/papers/bpcfl.md#table-7); full-batch pretraining
    (docs/papers/bpcfl.md#s8-5: 20 points < the batch size 50).

    Attributes:
      pretrain_lr: learning rate of pretraining (with the sampler's optimizer, docs/papers/bpcfl.md#s8-6).
      sampler: the inner chain's optimizer, the paper's "mcmc sampler" (sgd or adam).
      sampler_lr: eta, its step size.
      inference: the server's downstream inference: sgd or adam (MAP), hmc (blackjax), sgld.
      map_lr: learning rate of the MAP optimizer (sgd, adam, and hmc_start = map).
      map_steps: MAP steps.
      hmc_step_size: HMC leapfrog step epsilon.
      hmc_inverse_mass: c of the inverse mass matrix c I.
      hmc_integration_steps: L, leapfrog steps per transition.
      hmc_burnin: transitions before the first kept sample (the paper's "number of steps").
      hmc_samples: samples kept.
      hmc_mode: consecutive (burn-in then consecutive states) or chains (independent chains, final states).
      hmc_start: init (the network initialisation) or map (the MAP estimate).
      sgld_step_size: SGLD step.
      sgld_burnin: SGLD steps before the first sample.
      sgld_samples: SGLD samples kept.
      sgld_thinning: SGLD steps between kept samples.
    """

    name: ClassVar[str] = "bpcfl"
    coders: ClassVar[tuple[str, ...]] = ("pseudocoreset",)
    limits: ClassVar = {
        ">= 1": "map_steps hmc_integration_steps hmc_samples sgld_samples sgld_thinning",
        ">= 0": "hmc_burnin sgld_burnin",
        "> 0": "pretrain_lr sampler_lr map_lr hmc_step_size hmc_inverse_mass sgld_step_size",
    }

    pretrain_lr: float = 1e-2
    sampler: str = choice("adam", ("sgd", "adam"))
    sampler_lr: float = 1e-2
    inference: str = choice("sgd", ("sgd", "adam", "hmc", "sgld"))
    map_lr: float = 2e-2
    map_steps: int = 500
    hmc_step_size: float = 2e-3
    hmc_inverse_mass: float = 100.0
    hmc_integration_steps: int = 30
    hmc_burnin: int = 40
    hmc_samples: int = 50
    hmc_mode: str = choice("consecutive", ("consecutive", "chains"))
    hmc_start: str = choice("init", ("init", "map"))
    sgld_step_size: float = 1e-4
    sgld_burnin: int = 1000
    sgld_samples: int = 50
    sgld_thinning: int = 10

    def check(self) -> None:
        """The library's checks of the settings (:func:`sidejax.algorithms.bpcfl.check_settings`)."""
        self.relabel(check_settings, self.settings(None))

    def check_data(self, client_sizes) -> None:
        """Refuses a federation in which a client has fewer than ``num_points`` examples, or none at all
        (:func:`sidejax.algorithms.check_client_sizes`), before anything runs."""
        check_client_sizes(self.num_points, client_sizes)

    def settings(self, num_classes: int | None) -> BPCFLSettings:
        """The library's :class:`sidejax.algorithms.BPCFLSettings` (classification with ``num_classes``)."""
        return self.library_value(
            BPCFLSettings,
            num_classes=num_classes,
            step_size_labels=0.0,
            pretrain_optimizer=make_optimizer(self.sampler, self.pretrain_lr),
            chain_optimizer=make_optimizer(self.sampler, self.sampler_lr),
        )

    def inference_kernel(self):
        """The :class:`sidejax.algorithms.Inference` of :attr:`inference`."""
        if self.inference in ("sgd", "adam"):
            return map_inference(
                make_optimizer(self.inference, self.map_lr), self.map_steps, name=self.inference
            )
        if self.inference == "hmc":
            start = map_inference(optax.sgd(self.map_lr), self.map_steps) if self.hmc_start == "map" else None
            return hmc_inference(
                step_size=self.hmc_step_size,
                num_integration_steps=self.hmc_integration_steps,
                inverse_mass_matrix=self.hmc_inverse_mass,
                num_burnin=self.hmc_burnin,
                num_samples=self.hmc_samples,
                mode=self.hmc_mode,
                start=start,
            )
        return sgld_inference(
            step_size=self.sgld_step_size,
            num_burnin=self.sgld_burnin,
            num_samples=self.sgld_samples,
            thinning=self.sgld_thinning,
        )

    def algorithm(self, b: Build) -> Algorithm:
        """``b.coder`` is the pseudocoreset coder config's factory ``coder(num_classes)`` (the stream's label
        width depends on the dataset); ``b.model`` the :class:`experiments.algorithms.ModelContext`."""
        if b.model is None:
            raise ValueError("bpcfl needs the model context (init_fn, input_shape, num_classes) to build")
        return bpcfl(
            b.loss_fn,
            b.model.init_fn,
            input_shape=b.model.input_shape,
            num_clients=b.num_clients,
            settings=self.settings(b.model.num_classes),
            inference=self.inference_kernel(),
            coder=b.coder(b.model.num_classes),
        )


@dataclass(frozen=True)
@fills(
    DOSFLSettings,
    skip=("num_classes", "input_optimizer", "label_optimizer", "lr_optimizer"),
    rename={"num_steps": "distill_steps", "num_epochs": "distill_epochs", "batch_size": "distill_batch_size"},
    defaults={
        "distill_steps": 30,
        "distill_epochs": 20,
        "distill_batch_size": 30,
        "num_updates": 200,
        "init_std": 0.6,
    },
)
class DOSFLConfig(OneShotMethodConfig):
    """DOSFL (:func:`sidejax.algorithms.dosfl`): one round in which every client uploads distilled data
    ``(x̃, ỹ, η̃)``, which the server replays in sequence (:class:`sidejax.algorithms.DOSFLSettings`'s
    fields, for classification: the labels are hard and fixed). Defaults: the paper's Table 4, 2-D
    classification column (docs/papers/bpcfl.md#table-4); ``num_updates`` and ``init_std`` (BPC-FL's moons
    σ_z) are not in it (docs/papers/bpcfl.md#dosfl).

    Attributes:
      input_optimizer: the distilled inputs' optimizer: sgd, momentum (0.9, Table 4) or adam.
      input_lr: its step size.
      lr_optimizer: the optimizer of the step size η̃: none (η̃ fixed), sgd, momentum or adam.
      lr_step_size: its step size (lr_optimizer other than none).
    """

    name: ClassVar[str] = "dosfl"
    coders: ClassVar[tuple[str, ...]] = ("float32",)
    limits: ClassVar = {"> 0": "input_lr lr_step_size"}

    input_optimizer: str = choice("momentum", OPTIMIZERS)
    input_lr: float = 0.01
    lr_optimizer: str = choice("adam", ("none", *OPTIMIZERS))
    lr_step_size: float = 1e-4

    def settings(self, num_classes: int | None) -> DOSFLSettings:
        """The library's :class:`sidejax.algorithms.DOSFLSettings` (classification with ``num_classes``)."""
        lr_opt = None if self.lr_optimizer == "none" else make_optimizer(self.lr_optimizer, self.lr_step_size)
        return self.library_value(
            DOSFLSettings,
            num_classes=num_classes,
            input_optimizer=make_optimizer(self.input_optimizer, self.input_lr),
            lr_optimizer=lr_opt,
        )

    def check(self) -> None:
        """The library's checks of the scalar settings (:func:`sidejax.algorithms.dosfl.check_dosfl_settings`;
        the optimizers, made from the checked names and step sizes when the algorithm is built, stand in as
        ``optax.identity()``)."""
        placeholder = optax.identity()
        lr_opt = None if self.lr_optimizer == "none" else placeholder
        settings = self.library_value(
            DOSFLSettings, num_classes=2, input_optimizer=placeholder, lr_optimizer=lr_opt
        )
        self.relabel(check_dosfl_settings, settings)

    def algorithm(self, b: Build) -> Algorithm:
        """``b.model`` is the :class:`experiments.algorithms.ModelContext` (one example's input shape, the
        number of classes)."""
        if b.model is None:
            raise ValueError("dosfl needs the model context (input_shape, num_classes) to build")
        return dosfl(
            b.loss_fn,
            input_shape=b.model.input_shape,
            num_clients=b.num_clients,
            settings=self.settings(b.model.num_classes),
            coder=b.coder,
        )


#: the method configs by ``[method] name``
METHODS: dict[str, type[MethodConfig]] = by_name(
    FedAvgConfig,
    FedPMConfig,
    QSGDConfig,
    SignSGDConfig,
    QLSDConfig,
    SGLDConfig,
    BICompFLGRConfig,
    BICompFLReconstConfig,
    BICompFLPRConfig,
    *ERROR_FEEDBACK_METHODS,
    LIECConfig,
    M3Config,
    CepamConfig,
    PFedBayesConfig,
    PFedBayesSubsetConfig,
    CoresetPFedBayesConfig,
    PFedMeConfig,
    PerFedAvgConfig,
    FedPAConfig,
    BPCFLConfig,
    DOSFLConfig,
)

#: the algorithm names of the results tables and plots: (method, coder) pairs
SHORTCUTS: dict[str, tuple[str, str]] = {
    "fedavg": ("fedavg", "float32"),
    "fedpm": ("fedpm", "mask"),
    "fedpm_klms": ("fedpm", "klms"),
    "qsgd": ("qsgd", "elias"),
    "qsgd_klms": ("qsgd", "klms"),
    "signsgd": ("signsgd", "signs"),
    "signsgd_klms": ("signsgd", "klms"),
    "qlsd": ("qlsd", "elias"),
    "sgld_klms": ("sgld", "klms"),
}

for _method, _coder in SHORTCUTS.values():
    assert _coder in METHODS[_method].coders and _coder in CODERS


def algorithm_name(method: str, coder: str) -> str:
    """The shortcut of a (method, coder) pair (``fedpm_klms``), or ``method+coder`` (``sgld+float32``)."""
    for name, pair in SHORTCUTS.items():
        if pair == (method, coder):
            return name
    return f"{method}+{coder}"


def parse_algorithm(name: str) -> tuple[str, str]:
    """The (method, coder) pair of a shortcut or of ``method+coder``; ``ValueError`` for anything else."""
    if name in SHORTCUTS:
        return SHORTCUTS[name]
    method, plus, coder = name.partition("+")
    if plus and method in METHODS and coder in METHODS[method].coders:
        return method, coder
    pairs = [
        f"{m}+{c}" for m, cls in METHODS.items() for c in cls.coders if algorithm_name(m, c) == f"{m}+{c}"
    ]
    raise ValueError(
        f"unknown algorithm {name!r}; valid algorithms: {', '.join(sorted(SHORTCUTS))} (or method+coder: "
        f"{', '.join(pairs)})"
    )
