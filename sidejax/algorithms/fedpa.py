"""Federated posterior averaging, FedPA (Al-Shedivat, Gillenwater, Xing and Rostamizadeh, "Federated
Learning via Posterior Averaging: A New Perspective and Practical Algorithms", ICLR 2021): the BPC-FL
paper's FedPA baseline (docs/papers/bpcfl.md#a7, docs/papers/bpcfl.md#table-5).

FedPA reads FedAvg's pseudo-gradient as an estimate of the global posterior mode: with Gaussian local
posteriors :math:`\\mathcal N(\\mu_i, \\Sigma_i)`, the global posterior mean solves
:math:`(\\sum_i q_i \\Sigma_i^{-1})\\,\\mu = \\sum_i q_i \\Sigma_i^{-1} \\mu_i`, and the server can find it by
(server-)optimizing with the pseudo-gradient :math:`\\sum_i q_i \\Delta_i`,
:math:`\\Delta_i = \\Sigma_i^{-1}(x_t - \\mu_i)`, the gradient at :math:`x_t` of the quadratic
:math:`\\tfrac12 \\sum_i q_i (x - \\mu_i)^\\top \\Sigma_i^{-1} (x - \\mu_i)` (the paper's posterior-inference
view of federated learning). FedAvg is the special case :math:`\\Sigma_i = I`,
:math:`\\mu_i = y_i`.

Round ``t`` with participants :math:`S_t` and example counts :math:`n_i` (:math:`q_i = n_i / \\sum_j n_j`):

- downlink: :math:`x_t` as float32 (FedAvg's, :func:`sidejax.algorithms.fedavg.fedavg_broadcast`);
- client :math:`i`: ``burnin + ℓ·k`` local steps of the client optimizer from :math:`x_t`
  (``local_burnin_steps``, ``num_samples`` ℓ and ``steps_per_sample`` k of :class:`FedPASettings`),
  collecting ℓ samples :math:`\\theta_1, \\dots, \\theta_\\ell` (:func:`sidejax.fl.build_sampling_trainer`)
  and ending at :math:`y_i`. In a burn-in round (:math:`t <` ``burn_in_rounds``) its pseudo-gradient is
  FedAvg's, :math:`\\Delta_i = x_t - y_i`; afterwards
  :math:`\\Delta_i = \\hat\\Sigma_i^{-1}(x_t - \\hat\\mu_i)` with the sample mean :math:`\\hat\\mu_i` and the
  shrinkage covariance :math:`\\hat\\Sigma_i = \\rho I + (1 - \\rho) \\hat S_i` (:func:`fedpa_delta`);
- server: :math:`\\Delta = \\sum_i q_i \\Delta_i` and :math:`x_{t+1} = \\mathrm{ServerOpt}(x_t, \\Delta)`:
  FedAvg's server step (:func:`sidejax.algorithms.fedavg.fedavg_server_update`, FedOpt's sign convention:
  the optimizer *descends* along the pseudo-gradient :math:`x_t - \\bar y`), with :math:`\\Delta_i` in place
  of the model change :math:`x_t - y_i`.

The round counter is part of the server state (:class:`FedPAState`), which every party knows, so the
burn-in switch is a ``lax.cond`` on it, never a Python branch on a traced value.

Uplink: the client sends the point :math:`x_t - \\Delta_i` (in burn-in exactly :math:`y_i`, FedAvg's
message) with ``coder`` against ``p`` = the point mass at :math:`x_t`, and the server runs FedAvg's decode,
weighted mean and step on it, so its pseudo-gradient is :math:`x_t - \\sum_i q_i (x_t - \\Delta_i)`. [R]
docs/papers/bpcfl.md#a7 says "up Δ"; sending :math:`x_t - \\Delta_i` instead costs the same ``32 P`` bits with
:func:`sidejax.coding.float32_coder` (read from the messages), makes a burn-in round FedAvg's round bit for
bit, and lets any coder of FedAvg's model messages (relative to :math:`x_t`) code it. Its one extra
rounding, :math:`\\mathrm{fl}(x_t - \\Delta_i)`, is at most half an ulp of the sent coordinate, the size of
the roundings in FedAvg's own :math:`x_t - \\sum_i q_i y_i`. Downlink: ``32 P`` bits. Together the
``2·P`` floats per participant per round of docs/papers/bpcfl.md#a8.

Decisions where docs/papers/bpcfl.md#a7 is silent, marked [R] (docs/papers/bpcfl.md#dep-fedpa):

- [R] **How the samples are collected.** The FedPA paper's experiments draw the local samples with
  iterate-averaged SGD (IASG, Mandt, Hoffman and Blei 2017; the reference code's
  ``IterateAveragedStochasticGradientSampler``): after some burn-in steps, each sample is the average of
  the iterates of a window of consecutive SGD steps (the reference code's ``avg_steps``). Here:
  ``local_burnin_steps`` steps, then ℓ windows of ``steps_per_sample`` steps; with ``average_iterates=True``
  (the default, IASG) sample :math:`l` is the mean of the iterates after the steps of window :math:`l`, with
  ``False`` the iterate after its last step (the "collects ℓ iterates" of docs/papers/bpcfl.md#a7). With
  ``steps_per_sample = 1`` both read the ℓ last iterates. Steps count along the local schedule of
  :func:`sidejax.fl.build_local_trainer` (one epoch = ``ceil(max_examples / batch_size)`` steps), so
  "one sample per epoch" is ``steps_per_sample = steps_per_epoch``. The client optimizer's state (momentum)
  runs on through the burn-in and the windows and starts afresh every round.
- [R] **The sample covariance** is :math:`\\hat S = \\frac{1}{\\ell - 1} \\sum_l (\\theta_l - \\hat\\mu)
  (\\theta_l - \\hat\\mu)^\\top` (the unbiased estimate, ``jnp.cov``'s, as in the FedPA reference code); with
  ℓ = 1 it is 0, so :math:`\\hat\\Sigma = \\rho I` and :math:`\\Delta = (x_t - \\theta_1)/\\rho`.
- [R] **The shrinkage parameterisation.** docs/papers/bpcfl.md#a7 writes
  :math:`\\hat\\Sigma = \\rho I + (1-\\rho)\\hat S` with ρ = 0.1 (``shrinkage_form="direct"``, the default).
  The FedPA paper and its reference code (``ShrinkageMomentEstimator``) use
  :math:`\\rho_\\ell = 1 / (1 + (\\ell - 1)\\rho)` in that place, ρ ≥ 0 the hyperparameter (so
  :math:`\\hat\\Sigma_\\ell \\propto I + \\rho M_\\ell`, :math:`M_\\ell` the scatter matrix);
  ``shrinkage_form="fedpa"`` reads ``shrinkage`` that way (ρ = 0.1 and ℓ = 10 give
  :math:`\\rho_\\ell = 0.526`, not 0.1). Which one the BPC-FL paper's "shrinkage 0.1" meant is not said.
  The two differ in scale: where the samples' spread is small against the shrinkage (:math:`\\hat S \\ll
  \\rho I`, as for SGD iterates), :math:`\\hat\\Sigma \\approx \\rho I` and :math:`\\Delta \\approx
  (x_t - \\hat\\mu) / \\rho`, so the server steps as FedAvg's (at the iterate mean) with its learning rate
  multiplied by :math:`1/\\rho` (direct: 10) or :math:`1 + (\\ell - 1)\\rho` (FedPA's: 1.9). On the BPC-FL
  suite's ``fmnist_cpu`` the direct form diverges after the burn-in and the FedPA paper's form converges
  (measured in docs/papers/bpcfl.md#dep-fedpa); that suite setting uses ``"fedpa"``.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.fedavg import (
    fedavg_broadcast,
    fedavg_init,
    fedavg_receive,
    fedavg_server_update,
)
from sidejax.coding.base import Coder, float32_coder, included
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundState
from sidejax.fl.local import build_sampling_trainer
from sidejax.keys import ClientKeys, client_streams
from sidejax.types import Params
from sidejax.utils import check_count

__all__ = [
    "SHRINKAGE_FORMS",
    "FedPASettings",
    "FedPAState",
    "check_fedpa_settings",
    "effective_shrinkage",
    "fedpa_delta",
    "fedpa_init",
    "fedpa_client_update",
    "fedpa_server_update",
    "fedpa",
]

#: ``"direct"``: Σ̂ = ρI + (1 − ρ)Ŝ (docs/papers/bpcfl.md#a7); ``"fedpa"``: ρ_ℓ = 1/(1 + (ℓ − 1)ρ) in place of
#: ρ (the FedPA paper and reference code)
SHRINKAGE_FORMS = ("direct", "fedpa")


class FedPASettings(NamedTuple):
    """FedPA's settings (defaults: the BPC-FL paper's Table 5 for EMNIST-62, with ℓ = 10 one-step windows,
    i.e. the "10 local steps" of its Table 1).

    Attributes:
      burn_in_rounds: the first ``burn_in_rounds`` rounds (``t < burn_in_rounds``) are FedAvg rounds (an
        integer >= 0; Table 5: 500).
      num_samples: ℓ, local samples per client and round (an integer >= 1; Table 5: 10).
      shrinkage: ρ of the shrinkage covariance, in (0, 1] with ``shrinkage_form="direct"`` (ρ = 1: Σ̂ = I and
        Δ = x − μ̂), >= 0 with ``"fedpa"`` (Table 5: 0.1).
      local_burnin_steps: local steps before the first sample window (an integer >= 0).
      steps_per_sample: local steps per sample window (an integer >= 1); a round runs
        ``local_burnin_steps + num_samples * steps_per_sample`` local steps, in burn-in rounds too.
      average_iterates: a sample is the mean of its window's iterates (IASG, FedPA's experiments; ``True``) or
        its window's last iterate (``False``).
      shrinkage_form: how ``shrinkage`` enters Σ̂, one of :data:`SHRINKAGE_FORMS`.
    """

    burn_in_rounds: int = 500
    num_samples: int = 10
    shrinkage: float = 0.1
    local_burnin_steps: int = 0
    steps_per_sample: int = 1
    average_iterates: bool = True
    shrinkage_form: str = "direct"

    @property
    def local_steps(self) -> int:
        """Local steps per round: ``local_burnin_steps + num_samples * steps_per_sample``."""
        return self.local_burnin_steps + self.num_samples * self.steps_per_sample


class FedPAState(NamedTuple):
    """Server state: FedAvg's (:class:`sidejax.algorithms.FedAvgState`: the global parameters, the server
    optimizer's state, the coder's state) and the round counter every party knows (int32, the index of the
    next round)."""

    params: Params
    opt_state: optax.OptState
    coder: object
    round: jax.Array


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_fedpa_settings(settings: FedPASettings) -> FedPASettings:
    """``settings`` with the counts as ints, if every field is in its range.

    Raises:
      ValueError: naming the first field out of range and its valid range.
    """
    if not isinstance(settings, FedPASettings):
        raise ValueError(f"settings must be a FedPASettings, got {type(settings).__name__}")
    burn_in = check_count(settings.burn_in_rounds, "burn_in_rounds", minimum=0)
    num_samples = check_count(settings.num_samples, "num_samples")
    burnin_steps = check_count(settings.local_burnin_steps, "local_burnin_steps", minimum=0)
    every = check_count(settings.steps_per_sample, "steps_per_sample")
    if not isinstance(settings.average_iterates, bool):
        raise ValueError(f"average_iterates must be a bool, got {settings.average_iterates!r}")
    if settings.shrinkage_form not in SHRINKAGE_FORMS:
        raise ValueError(
            f"shrinkage_form must be one of {list(SHRINKAGE_FORMS)}, got {settings.shrinkage_form!r}"
        )
    rho = settings.shrinkage
    if settings.shrinkage_form == "direct" and not (_is_real(rho) and 0 < rho <= 1):
        raise ValueError(f"shrinkage must be a number in (0, 1] (shrinkage_form='direct'), got {rho!r}")
    if settings.shrinkage_form == "fedpa" and not (_is_real(rho) and rho >= 0):
        raise ValueError(f"shrinkage must be a finite number >= 0 (shrinkage_form='fedpa'), got {rho!r}")
    return settings._replace(
        burn_in_rounds=burn_in,
        num_samples=num_samples,
        shrinkage=float(rho),
        local_burnin_steps=burnin_steps,
        steps_per_sample=every,
    )


def effective_shrinkage(settings: FedPASettings) -> float:
    """The ρ of Σ̂ = ρI + (1 − ρ)Ŝ that ``settings`` mean: ``shrinkage`` (``"direct"``), or the FedPA
    paper's :math:`\\rho_\\ell = 1 / (1 + (\\ell - 1)\\rho)` (``"fedpa"``)."""
    settings = check_fedpa_settings(settings)
    if settings.shrinkage_form == "direct":
        return settings.shrinkage
    return 1.0 / (1.0 + (settings.num_samples - 1) * settings.shrinkage)


def fedpa_delta(samples: jax.Array, x: jax.Array, shrinkage) -> jax.Array:
    """FedPA's client pseudo-gradient :math:`\\Delta = \\hat\\Sigma^{-1}(x - \\hat\\mu)` from ℓ samples, with
    no ``P × P`` matrix: the FedPA paper's dynamic programme over the samples (the reference code's
    ``compute_post_avg_delta_dp``), ``O(ℓ² P)`` time and
    ``O(ℓ P)`` memory.

    With :math:`\\hat\\mu` the sample mean, :math:`\\hat S = \\frac{1}{\\ell - 1} M_\\ell` the unbiased sample
    covariance (0 for ℓ = 1) and :math:`\\hat\\Sigma = \\rho I + (1 - \\rho) \\hat S`:

    .. math::

        \\hat\\Sigma = \\rho\\,(I + \\beta M_\\ell), \\qquad
        \\beta = \\frac{1 - \\rho}{\\rho (\\ell - 1)}, \\qquad
        M_\\ell = \\sum_{t=2}^{\\ell} \\gamma_t' u_t u_t^\\top, \\quad \\gamma_t' = \\frac{t - 1}{t}, \\quad
        u_t = \\theta_t - \\hat\\mu_{t-1},

    Welford's recursion for the scatter matrix (:math:`\\hat\\mu_t = \\hat\\mu_{t-1} + u_t / t`). With
    :math:`A_1 = I` and :math:`A_t = A_{t-1} + \\gamma_t u_t u_t^\\top`,
    :math:`\\gamma_t = \\beta \\gamma_t'`, Sherman–Morrison gives
    :math:`A_t^{-1} z = A_{t-1}^{-1} z - c_t v_t (v_t^\\top z)` with
    :math:`v_t = A_{t-1}^{-1} u_t = u_t - \\sum_{k<t} c_k v_k (v_k^\\top u_t)` and
    :math:`c_t = \\gamma_t / (1 + \\gamma_t u_t^\\top v_t)`, so

    .. math::

        \\Delta = \\frac{1}{\\rho}\\Big(z - \\sum_{t=2}^{\\ell} c_t v_t (v_t^\\top z)\\Big), \\qquad
        z = x - \\hat\\mu_\\ell .

    One ``lax.scan`` step per sample computes :math:`v_t` and :math:`c_t` from the earlier ones (rows of an
    ``[ℓ, P]`` buffer, zero until written). Every denominator is :math:`1 + \\gamma_t u_t^\\top v_t \\ge 1`
    (:math:`A_{t-1}` is positive definite), so the recursion is stable for any samples. The FedPA paper's
    parameterisation (:math:`\\rho_\\ell` in place of ρ, :func:`effective_shrinkage`) is the same recursion
    with :math:`\\beta` = its ρ.

    Args:
      samples: ``[ℓ, P]``, the samples :math:`\\theta_1, \\dots, \\theta_\\ell` (ℓ >= 1, static).
      x: ``[P]``, the point the pseudo-gradient is taken at (the global model :math:`x_t`).
      shrinkage: ρ in (0, 1] (a Python float or a scalar array; not checked here: see
        :func:`check_fedpa_settings`).

    Returns:
      ``[P]``, Δ in the dtype of ``samples`` (float64 if x64 is on and ``samples`` is float64).
    """
    samples = jnp.asarray(samples)
    num = samples.shape[0]
    dtype = samples.dtype
    rho = jnp.asarray(shrinkage, dtype)
    beta = (1 - rho) / (rho * (num - 1)) if num > 1 else jnp.zeros((), dtype)

    def step(carry, inputs):
        mean, vs, cs = carry
        theta, j = inputs  # sample t = j + 1 (1-based), j = 1 .. ℓ - 1
        t = (j + 1).astype(dtype)
        u = theta - mean
        v = u - jnp.sum((cs * jnp.sum(vs * u, axis=1))[:, None] * vs, axis=0)
        gamma = beta * (t - 1) / t
        c = gamma / (1 + gamma * jnp.sum(u * v))
        vs = jax.lax.dynamic_update_index_in_dim(vs, v, j, 0)
        cs = jax.lax.dynamic_update_index_in_dim(cs, c, j, 0)
        return (mean + u / t, vs, cs), None

    init = (samples[0], jnp.zeros_like(samples), jnp.zeros((num,), dtype))
    (mean, vs, cs), _ = jax.lax.scan(step, init, (samples[1:], jnp.arange(1, num)))
    z = jnp.asarray(x, dtype) - mean
    return (z - jnp.sum((cs * jnp.sum(vs * z, axis=1))[:, None] * vs, axis=0)) / rho


def fedpa_init(server_optimizer, coder: Coder, key, params: Params, num_clients: int) -> RoundState:
    """FedAvg's initial state (:func:`sidejax.algorithms.fedavg.fedavg_init`) with the round counter at 0."""
    state = fedavg_init(server_optimizer, coder, key, params, num_clients)
    server = state.server
    return state._replace(server=FedPAState(server.params, server.opt_state, server.coder, jnp.int32(0)))


def fedpa_client_update(
    train, settings: FedPASettings, coder: Coder, keys: ClientKeys, server: FedPAState, state, data
):
    """One client: ``settings.local_steps`` local steps from the received model, collecting ℓ samples
    (``train`` from :func:`sidejax.fl.build_sampling_trainer`), then the point :math:`x_t - \\Delta_i` through
    ``coder`` against the point mass at :math:`x_t`: :math:`y_i` (FedAvg's message) in a burn-in round
    (``server.round < settings.burn_in_rounds``), :math:`x_t - \\hat\\Sigma^{-1}(x_t - \\hat\\mu)` afterwards
    (:func:`fedpa_delta`). ``settings`` must have passed :func:`check_fedpa_settings`."""
    streams = client_streams(keys.private)
    params, samples, info = train(streams.train, server.params, data)
    x = ravel_pytree(server.params)[0]
    y = ravel_pytree(params)[0]
    rho = effective_shrinkage(settings)
    sent = jax.lax.cond(
        server.round < settings.burn_in_rounds,
        lambda: y,
        lambda: x - fedpa_delta(samples, x, rho),
    )
    sample_keys = ClientKeys(keys.shared, streams.sample)
    message, cinfo = coder.encode(sample_keys, PointMass(sent), PointMass(x), server.coder)
    return (
        state,
        message,
        ClientInfo(
            loss=info.loss,
            finite=info.finite & jnp.all(jnp.isfinite(sent)),
            extra=info.num_steps,
            valid=cinfo.valid,
        ),
    )


def fedpa_server_update(
    server_optimizer, coder: Coder, rkey, server: FedPAState, client_ids, shared_keys, messages, weights
):
    """FedAvg's server (:func:`sidejax.algorithms.fedavg.fedavg_server_update`: decode, example-weighted mean
    :math:`\\bar s = \\sum_i q_i (x_t - \\Delta_i)`, then plain averaging or a FedOpt step on
    :math:`x_t - \\bar s = \\sum_i q_i \\Delta_i`, over the included participants), and the round counter
    advanced (kept, with the rest of the state, when none is included)."""
    new, info, errors = fedavg_server_update(
        server_optimizer, coder, rkey, server, client_ids, shared_keys, messages, weights
    )
    anyone = jnp.any(included(messages, errors == 0))
    return (
        FedPAState(new.params, new.opt_state, new.coder, server.round + anyone.astype(jnp.int32)),
        info,
        errors,
    )


def fedpa(
    loss_fn: Callable,
    *,
    clients_per_round: int,
    client_optimizer: optax.GradientTransformation,
    batch_size: int,
    settings: FedPASettings | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds FedPA (see the module docstring; Table 5: ``client_optimizer = optax.sgd(0.01,
    momentum=0.9)``, ``server_optimizer = optax.sgd(0.5, momentum=0.9)``, ``FedPASettings()``).

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (see :mod:`sidejax.fl.local`).
      clients_per_round: participants per round.
      client_optimizer: the clients' Optax optimizer (fresh state every round).
      batch_size: local minibatch size.
      settings: :class:`FedPASettings` (burn-in rounds, samples, shrinkage, the local sampling schedule);
        default ``FedPASettings()`` (Table 5).
      server_optimizer: the FedOpt server optimizer on the pseudo-gradient :math:`\\sum_i q_i \\Delta_i`;
        ``None``: :math:`x_{t+1} = x_t - \\sum_i q_i \\Delta_i` (plain averaging in burn-in rounds).
      coder: the uplink coder of the point :math:`x_t - \\Delta_i` (``p``: the point mass at :math:`x_t`);
        default :func:`sidejax.coding.float32_coder`.

    Returns:
      An :class:`sidejax.fl.Algorithm`.

    Raises:
      ValueError: if a setting is out of range (naming it) or ``batch_size`` is not an integer >= 1.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from sidejax.algorithms import FedPASettings, fedpa
      >>> loss = lambda p, b, k: jnp.sum(b.mask * (b.x[:, 0] * p["w"] - b.y) ** 2) / b.mask.sum()
      >>> algo = fedpa(loss, clients_per_round=2, client_optimizer=optax.sgd(0.1), batch_size=4,
      ...              settings=FedPASettings(burn_in_rounds=2, num_samples=3))
      >>> int(algo.init(jax.random.key(0), {"w": jnp.zeros(())}, 3).server.round)
      0
    """
    settings = check_fedpa_settings(FedPASettings() if settings is None else settings)
    coder = float32_coder() if coder is None else coder
    train = build_sampling_trainer(
        loss_fn,
        client_optimizer,
        batch_size=batch_size,
        burnin_steps=settings.local_burnin_steps,
        steps_per_sample=settings.steps_per_sample,
        num_samples=settings.num_samples,
        average=settings.average_iterates,
    )
    return Algorithm(
        init=functools.partial(fedpa_init, server_optimizer, coder),
        broadcast=functools.partial(fedavg_broadcast, coder),
        receive=functools.partial(fedavg_receive, coder),
        client_update=functools.partial(fedpa_client_update, train, settings, coder),
        server_update=functools.partial(fedpa_server_update, server_optimizer, coder),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=clients_per_round,
    )
