"""Bayesian FL with Langevin dynamics: QLSD (Vono et al., 2022) and SGLD-KLMS (KLMS paper Alg. 4 and 12;
docs/papers/klms.md#s4-6).

Client ``c`` evaluates a stochastic gradient of its potential at the global sample :math:`\\theta` on one
minibatch :math:`S_c` of size ``B`` ([C]: 64, one minibatch per round):

.. math::

    H_c(\\theta) = |D_c| \\, \\nabla_\\theta \\Big[\\frac{1}{|S_c|}\\sum_{j \\in S_c} \\ell_j(\\theta)\\Big]
    + 2 \\lambda \\theta

(cross-entropy plus the reference code's Gaussian-prior share :math:`\\frac{\\lambda}{|D_c|}\\|\\theta\\|^2`
per example, :math:`\\lambda` = ``weight_decay``, [C] 5). With :math:`a = N / C` and step size
:math:`\\gamma` (the paper's :math:`\\eta_S` and :math:`\\gamma` are one step size, docs/papers/klms.md#s8-5):

- **QLSD** (:func:`qlsd`) sends :math:`H_c` through QSGD with ``s`` levels ([C] s = 5; by default
  Elias-coded, as :mod:`sidejax.algorithms.qsgd`, with any levels coder accepted); the server steps
  :math:`\\theta \\leftarrow \\theta - \\gamma a \\sum_c \\hat H_c + \\sqrt{2\\gamma}\\,\\xi`,
  :math:`\\xi \\sim N(0, I)` drawn from the round's server key.
- **SGLD-KLMS** (:func:`sgld` with ``coder=klms_coder(config)``) sends a KLMS sample :math:`y_c` of
  :math:`q = N(H_c, \\sigma^2 I)` against
  :math:`p = N(0, \\sigma^2 I)` and the server steps
  :math:`\\theta \\leftarrow \\theta - \\gamma a \\sum_c y_c`
  with **no** extra noise: the clients' noise is the Langevin noise. The paper's
  :math:`N(0, \\sqrt{2/(\\gamma C^2)})` is ambiguous (and the reference code doubles the noise); the
  derivation of docs/papers/klms.md#s4-7 [R] gives :math:`\\gamma^2 a^2 C \\sigma^2 = 2\\gamma`, i.e.
  :math:`\\sigma^2 = 2 / (\\gamma a^2 C)`, used here. Per-coordinate KL: :math:`H_i^2 / (2\\sigma^2)` nats.
  With ``coder=float32_coder()`` the client sends its own Gaussian sample uncompressed (federated SGLD).

QLSD and SGLD are two builders, not one with a flag: they differ in the law that is coded (quantiser vs
Gaussian) and in where the Langevin noise comes from (the server vs the clients' samples).

The evaluated model is the current sample :math:`\\theta^{(t)}` (the paper averages predictions over
posterior samples after convergence, without saying how; docs/papers/klms.md#s8-32).
Downlink: :math:`\\theta` as float32, plus the protocol bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import DenseMethod, dense_algorithm
from sidejax.algorithms.qsgd import qsgd_method
from sidejax.coding.base import Coder, float32_coder
from sidejax.coding.sample import elias_coder
from sidejax.distributions import DiagGaussian
from sidejax.fl.base import Algorithm, Batch
from sidejax.fl.local import epoch_order
from sidejax.keys import ORDER, epoch_key, step_key, stream_key
from sidejax.types import Params
from sidejax.utils import masked_sum

__all__ = [
    "LangevinSettings",
    "sgld_klms_sigma",
    "minibatch_potential_grad",
    "potential_direction",
    "qlsd",
    "sgld",
]


def sgld_klms_sigma(step_size: float, num_clients: int, clients_per_round: int) -> float:
    """:math:`\\sigma = \\sqrt{2 / (\\gamma a^2 C)}` with :math:`a = N/C` (docs/papers/klms.md#s4-7 [R])."""
    a = num_clients / clients_per_round
    return math.sqrt(2.0 / (step_size * a * a * clients_per_round))


def minibatch_potential_grad(
    loss_fn: Callable, key, params: Params, data, batch_size: int, weight_decay: float
):
    """:math:`H_c(\\theta)` on one random minibatch of the client's data; returns ``(H_flat, loss)``.

    ``key`` is the client's training key; the minibatch is step 0 of epoch 0 of the local-training schedule
    (order from ``stream_key(epoch_key(key, 0), ORDER)``, loss key ``step_key(epoch_key(key, 0), 0)``).
    """
    ekey = epoch_key(key, 0)
    order = epoch_order(stream_key(ekey, ORDER), data.num_examples, data.indices.shape[0])
    take = jnp.arange(batch_size) % data.indices.shape[0]
    gidx = data.indices[order[take]]
    valid = (jnp.arange(batch_size) < data.num_examples).astype(jnp.float32)
    batch = Batch(x=data.x[gidx], y=data.y[gidx], mask=valid)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, step_key(ekey, 0))
    flat = ravel_pytree(params)[0]
    n = data.num_examples.astype(jnp.float32)
    return n * ravel_pytree(grads)[0] + 2.0 * weight_decay * flat, loss


def potential_direction(loss_fn: Callable, batch_size: int, weight_decay: float) -> Callable:
    """``direction`` of the Langevin methods: :math:`H_c` at the global sample, its loss, finiteness."""

    def direction(train_key, params, data):
        h, loss = minibatch_potential_grad(loss_fn, train_key, params, data, batch_size, weight_decay)
        return h, loss, jnp.isfinite(loss)

    return direction


class LangevinSettings(NamedTuple):
    """The Langevin chain's settings shared by :func:`qlsd` and :func:`sgld`.

    Attributes:
      batch_size: the minibatch B of the one local gradient ([C] 64).
      step_size: :math:`\\gamma` ([C] 1e-5).
      weight_decay: :math:`\\lambda` of the Gaussian prior ([C] 5).
    """

    batch_size: int = 64
    step_size: float = 1e-5
    weight_decay: float = 5.0


def _check(settings: LangevinSettings | None, num_clients: int, clients_per_round: int) -> LangevinSettings:
    settings = LangevinSettings() if settings is None else settings
    if not settings.step_size > 0:
        raise ValueError(f"step_size must be > 0, got {settings.step_size}")
    if settings.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {settings.batch_size}")
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(
            f"need 1 <= clients_per_round <= num_clients, got {clients_per_round}, {num_clients}"
        )
    return settings


def _langevin_step(flat, values, include, noise, step_size: float, num_clients: int, clients_per_round: int):
    """:math:`\\theta - \\gamma \\frac{N}{|I|} \\sum_{c \\in I} v_c + \\text{noise}`: the sum over the
    included participants ``I`` renormalised to stand for the whole federation's gradient. With every
    participant included it is the expression :math:`\\theta + (-\\gamma a \\sum_c v_c + \\text{noise})`,
    :math:`a = N/C`, itself (selected, not rewritten: the same constant and operations, so the same bits)."""
    a = num_clients / clients_per_round
    full = flat + (-step_size * a * jnp.sum(values, axis=0) + noise)
    count = jnp.sum(include)
    scale = step_size * num_clients / jnp.maximum(count, 1).astype(jnp.float32)
    partial = flat + (-scale * masked_sum(values, include) + noise)
    return jnp.where(count == clients_per_round, full, partial)


def qlsd(
    loss_fn: Callable,
    *,
    num_clients: int,
    clients_per_round: int,
    levels: int = 5,
    coder: Coder | None = None,
    settings: LangevinSettings | None = None,
) -> Algorithm:
    """Builds QLSD: QSGD-quantised potential gradients, Langevin noise added by the server.

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)`` (mean negative log-likelihood of a batch).
      num_clients: N, the federation size (checked against the data at ``init``).
      clients_per_round: C.
      levels: the QSGD levels ``s`` ([C] 5).
      coder: the levels' coder (default ``elias_coder(levels)``; norms are added as side information).
      settings: minibatch, step size and prior (:class:`LangevinSettings`; default ``LangevinSettings()``).
    """
    settings = _check(settings, num_clients, clients_per_round)
    step_size = settings.step_size
    coder = elias_coder(levels) if coder is None else coder

    def server_step(key, flat, hhat, include):
        noise = math.sqrt(2 * step_size) * jax.random.normal(key, flat.shape)
        return _langevin_step(flat, hhat, include, noise, step_size, num_clients, clients_per_round)

    method = qsgd_method(
        potential_direction(loss_fn, settings.batch_size, settings.weight_decay),
        levels=levels,
        clients_per_round=clients_per_round,
        prior_smoothing=1.0,
        server_step=server_step,
    )
    return dense_algorithm(method, coder, clients_per_round=clients_per_round, check_num_clients=num_clients)


def sgld(
    loss_fn: Callable,
    *,
    num_clients: int,
    clients_per_round: int,
    coder: Coder | None = None,
    settings: LangevinSettings | None = None,
) -> Algorithm:
    """Builds federated SGLD whose clients send one sample of :math:`N(H_c, \\sigma^2 I)`: SGLD-KLMS with
    ``coder=klms_coder(config)`` (against :math:`p = N(0, \\sigma^2 I)`), or the uncompressed sample with
    ``coder=float32_coder()``. The server steps :math:`\\theta \\leftarrow \\theta - \\gamma a \\sum_c y_c`.

    Args:
      loss_fn: as :func:`qlsd`.
      num_clients: as :func:`qlsd`.
      clients_per_round: as :func:`qlsd`.
      settings: as :func:`qlsd`.
      coder: the coder of the Gaussian samples (default ``float32_coder()``: the uncompressed sample).
    """
    settings = _check(settings, num_clients, clients_per_round)
    coder = float32_coder() if coder is None else coder
    step_size = settings.step_size
    sigma = sgld_klms_sigma(step_size, num_clients, clients_per_round)

    def server_step(key, flat, yhat, include):
        del key
        return _langevin_step(flat, yhat, include, 0.0, step_size, num_clients, clients_per_round)

    method = DenseMethod(
        direction=potential_direction(loss_fn, settings.batch_size, settings.weight_decay),
        law=lambda h, layout: DiagGaussian(h, jnp.full_like(h, sigma)),
        prior=lambda state, layout: DiagGaussian(
            jnp.zeros((layout.dim,), jnp.float32), jnp.full((layout.dim,), sigma, jnp.float32)
        ),
        reconstruct=lambda samples, layout: samples,
        server_step=server_step,
    )
    return dense_algorithm(method, coder, clients_per_round=clients_per_round, check_num_clients=num_clients)
