"""Bayesian FL with Langevin dynamics: QLSD (Vono et al., 2022) and SGLD-KLMS (KLMS paper Alg. 4 and 12;
spec ``klms.md`` §4.6-4.7).

Client ``c`` evaluates a stochastic gradient of its potential at the global sample :math:`\\theta` on one
minibatch :math:`S_c` of size ``B`` ([C]: 64, one minibatch per round):

.. math::

    H_c(\\theta) = |D_c| \\, \\nabla_\\theta \\Big[\\frac{1}{|S_c|}\\sum_{j \\in S_c} \\ell_j(\\theta)\\Big]
    + 2 \\lambda \\theta

(cross-entropy plus the reference code's Gaussian-prior share :math:`\\frac{\\lambda}{|D_c|}\\|\\theta\\|^2`
per example, :math:`\\lambda` = ``weight_decay``, [C] 5). With :math:`a = N / C` and step size
:math:`\\gamma` (the paper's :math:`\\eta_S` and :math:`\\gamma` are one step size, spec §8 #5):

- **QLSD** sends :math:`H_c` through QSGD with ``s`` levels ([C] s = 5; Elias-coded, as
  :mod:`sidejax.algorithms.qsgd`); the server steps
  :math:`\\theta \\leftarrow \\theta - \\gamma a \\sum_c \\hat H_c + \\sqrt{2\\gamma}\\,\\xi`,
  :math:`\\xi \\sim N(0, I)` drawn from the round's server key.
- **SGLD-KLMS** sends a KLMS sample :math:`y_c` of :math:`q = N(H_c, \\sigma^2 I)` against
  :math:`p = N(0, \\sigma^2 I)` and the server steps
  :math:`\\theta \\leftarrow \\theta - \\gamma a \\sum_c y_c`
  with **no** extra noise: the clients' noise is the Langevin noise. The paper's
  :math:`N(0, \\sqrt{2/(\\gamma C^2)})` is ambiguous (and the reference code doubles the noise); the spec's
  derivation (§4.7 [R]) gives :math:`\\gamma^2 a^2 C \\sigma^2 = 2\\gamma`, i.e.
  :math:`\\sigma^2 = 2 / (\\gamma a^2 C)`, used here. Per-coordinate KL: :math:`H_i^2 / (2\\sigma^2)` nats.

The evaluated model is the current sample :math:`\\theta^{(t)}` (the paper averages predictions over
posterior samples after convergence, without saying how; spec §8 #32).
Downlink: :math:`\\theta` as float32, plus the protocol bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.common import broadcast_params, client_streams, flat_layout
from sidejax.algorithms.qsgd import (
    CompressedExtra,
    CompressedServerInfo,
    qsgd_decode,
    qsgd_message,
    qsgd_quantize,
)
from sidejax.distributions import DiagGaussian
from sidejax.fl.base import Algorithm, Batch, ClientInfo, EmptyState, RoundState, initial_round_state
from sidejax.fl.local import epoch_order
from sidejax.fl.rounds import build_round_step
from sidejax.keys import ORDER, SERVER, ClientKeys, epoch_key, step_key, stream_key
from sidejax.klms import (
    KLMSConfig,
    KLMSState,
    klms_decode_clients,
    klms_encode,
    klms_init,
    klms_server_update,
)
from sidejax.types import Params

__all__ = ["LangevinState", "sgld_klms_sigma", "minibatch_potential_grad", "langevin"]


class LangevinState(NamedTuple):
    """Server state: the current posterior sample ``params`` and the KLMS protocol state."""

    params: Params
    klms: KLMSState | EmptyState


def sgld_klms_sigma(step_size: float, num_clients: int, clients_per_round: int) -> float:
    """:math:`\\sigma = \\sqrt{2 / (\\gamma a^2 C)}` with :math:`a = N/C` (spec §4.7 [R])."""
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


def langevin(
    loss_fn: Callable,
    *,
    num_clients: int,
    clients_per_round: int,
    batch_size: int = 64,
    step_size: float = 1e-5,
    weight_decay: float = 5.0,
    levels: int = 5,
    klms: KLMSConfig | None = None,
    paper_compat: bool = False,
    client_strategy: str | None = None,
    map_batch_size: int | None = None,
) -> Algorithm:
    """Builds QLSD (``klms=None``) or SGLD-KLMS.

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)`` (mean negative log-likelihood of a batch).
      num_clients: N, the federation size (checked against the data at ``init``).
      clients_per_round: C.
      batch_size: the minibatch B of the one local gradient.
      step_size: :math:`\\gamma` ([C] 1e-5).
      weight_decay: :math:`\\lambda` of the Gaussian prior ([C] 5).
      levels: QLSD's QSGD levels ``s`` ([C] 5).
      klms: KLMS settings for SGLD-KLMS ([C] ``max_block_size=16``).
      paper_compat: QLSD charges the reference code's Elias bound.
      client_strategy, map_batch_size: see :func:`sidejax.fl.build_round_step`.
    """
    if not step_size > 0:
        raise ValueError(f"step_size must be > 0, got {step_size}")
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(
            f"need 1 <= clients_per_round <= num_clients, got {clients_per_round}, {num_clients}"
        )
    a = num_clients / clients_per_round
    sigma = sgld_klms_sigma(step_size, num_clients, clients_per_round)

    def init(key, params: Params, n: int) -> RoundState:
        del key
        if n != num_clients:
            raise ValueError(f"langevin was built for num_clients={num_clients} but the data has {n} clients")
        kstate = klms_init(flat_layout(params).dim, klms) if klms is not None else EmptyState()
        return initial_round_state(LangevinState(params, kstate), EmptyState(), n)

    def broadcast_fn(key, server: LangevinState, client_ids):
        del key
        return broadcast_params(server, client_ids, klms)

    def client_update(keys: ClientKeys, server: LangevinState, state, data):
        layout = flat_layout(server.params)
        train_key, sample_key = client_streams(keys.private)
        h, loss = minibatch_potential_grad(loss_fn, train_key, server.params, data, batch_size, weight_decay)
        if klms is None:
            signed, norms = qsgd_quantize(sample_key, h, layout, levels)
            message = qsgd_message(signed, norms, layout, levels, paper_compat=paper_compat)
            extra = CompressedExtra(jnp.float32(jnp.nan), EmptyState())
        else:
            q = DiagGaussian(h, jnp.full_like(h, sigma))
            p = DiagGaussian(jnp.zeros_like(h), jnp.full_like(h, sigma))
            message, kinfo = klms_encode(ClientKeys(keys.shared, sample_key), q, p, server.klms, klms)
            extra = CompressedExtra(kinfo.kl_bits, kinfo)
        finite = jnp.isfinite(loss) & jnp.all(jnp.isfinite(h))
        return state, message, ClientInfo(loss=loss, finite=finite, extra=extra)

    def server_update(rkey, server: LangevinState, client_ids, messages, weights):
        del weights
        layout = flat_layout(server.params)
        flat, unravel = ravel_pytree(server.params)
        if klms is None:
            hhat = jax.vmap(lambda m: qsgd_decode(m, layout, levels))(messages)
            noise = math.sqrt(2 * step_size) * jax.random.normal(stream_key(rkey, SERVER), flat.shape)
            kstate, kinfo = server.klms, EmptyState()
        else:
            p = DiagGaussian(jnp.zeros_like(flat), jnp.full_like(flat, sigma))
            hhat, decoded = klms_decode_clients(rkey, client_ids, p, server.klms, messages, klms)
            noise = 0.0
            kstate, kinfo = klms_server_update(server.klms, decoded, klms)
        step = -step_size * a * jnp.sum(hhat, axis=0) + noise
        new = LangevinState(unravel(flat + step), kstate)
        return new, CompressedServerInfo(update_norm=jnp.linalg.norm(step), klms=kinfo)

    round_step = build_round_step(
        broadcast_fn,
        client_update,
        server_update,
        clients_per_round=clients_per_round,
        client_strategy=client_strategy,
        map_batch_size=map_batch_size,
    )
    return Algorithm(init=init, round_step=round_step, eval_params=lambda server: server.params)
