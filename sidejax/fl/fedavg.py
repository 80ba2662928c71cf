"""Federated Averaging (McMahan et al., 2017), uncompressed: the reference baseline.

Round ``t`` with participants :math:`S_t` and example counts :math:`n_i`:

.. math::

    w_i^{t+1} = \\mathrm{LocalOpt}_i(w^t), \\qquad
    \\bar w^{t+1} = \\sum_{i \\in S_t} \\frac{n_i}{\\sum_{j \\in S_t} n_j} \\, w_i^{t+1}

With ``server_optimizer=None`` the server takes :math:`w^{t+1} = \\bar w^{t+1}`. With a server optimizer
(FedOpt, Reddi et al. 2021) it steps on the pseudo-gradient :math:`w^t - \\bar w^{t+1}` instead.

Bits: the downlink sends :math:`w^t` and each client sends :math:`w_i^{t+1}` as float32 words
(:func:`sidejax.coding.encode_float32`), so both directions cost 32 bits per parameter per client,
measured from the payload. The clients use the *decoded* downlink message, and the server averages the
*decoded* uplink messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.coding.base import decode_float32, encode_float32
from sidejax.fl.base import Algorithm, ClientInfo, EmptyState, RoundState, initial_round_state
from sidejax.fl.local import build_local_trainer
from sidejax.fl.rounds import build_round_step
from sidejax.keys import client_streams
from sidejax.types import Params

__all__ = ["FedAvgState", "FedAvgServerInfo", "weighted_mean", "fedavg"]


class FedAvgState(NamedTuple):
    """Server state: the global parameters and the server optimizer's state (``EmptyState`` if none)."""

    params: Params
    opt_state: optax.OptState


class FedAvgServerInfo(NamedTuple):
    """Server diagnostics: the global norm of the round's model change."""

    update_norm: jax.Array


def weighted_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """Mean of ``values[clients, ...]`` with weights normalised to sum to 1 (exact for a single client)."""
    w = weights / jnp.sum(weights)
    return jnp.tensordot(w, values, axes=1)


def fedavg(
    loss_fn: Callable,
    client_optimizer: optax.GradientTransformation,
    *,
    clients_per_round: int,
    batch_size: int,
    local_epochs: int = 1,
    server_optimizer: optax.GradientTransformation | None = None,
    client_strategy: str | None = None,
    map_batch_size: int | None = None,
) -> Algorithm:
    """Builds FedAvg.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (see :mod:`sidejax.fl.local`).
      client_optimizer: the clients' Optax optimizer (state re-initialised every round).
      clients_per_round: participants per round.
      batch_size: local minibatch size.
      local_epochs: local epochs per round.
      server_optimizer: optional FedOpt server optimizer on the pseudo-gradient; ``None`` = plain averaging.
      client_strategy: ``"vmap"``, ``"map"``, or ``None`` for the backend's default (see
        :func:`sidejax.fl.build_round_step`).
      map_batch_size: clients vmapped per ``lax.map`` step with ``"map"``.

    Returns:
      An :class:`sidejax.fl.Algorithm`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from sidejax.fl import fedavg, Batch
      >>> loss = lambda p, b, k: jnp.sum(b.mask * (b.x[:, 0] * p["w"] - b.y) ** 2) / b.mask.sum()
      >>> algo = fedavg(loss, optax.sgd(0.1), clients_per_round=2, batch_size=4)
      >>> state = algo.init(jax.random.key(0), {"w": jnp.zeros(())}, 3)
      >>> int(state.round_index)
      0
    """
    local_train = build_local_trainer(
        loss_fn, client_optimizer, batch_size=batch_size, num_epochs=local_epochs
    )

    def init(key, params: Params, num_clients: int) -> RoundState:
        del key  # FedAvg clients hold no state
        opt_state = (
            server_optimizer.init(ravel_pytree(params)[0]) if server_optimizer is not None else EmptyState()
        )
        return initial_round_state(FedAvgState(params, opt_state), EmptyState(), num_clients)

    def broadcast_fn(key, server: FedAvgState, client_ids):
        del key
        flat, unravel = ravel_pytree(server.params)
        message = encode_float32(flat)
        return unravel(decode_float32(message)), jnp.full(client_ids.shape, message.num_bits)

    def client_update(keys, broadcast: Params, state, data):
        params, info = local_train(client_streams(keys.private).train, broadcast, data)
        flat, _ = ravel_pytree(params)
        return (
            state,
            encode_float32(flat),
            ClientInfo(loss=info.loss, finite=info.finite, extra=info.num_steps),
        )

    def server_update(rkey, server: FedAvgState, client_ids, messages, weights):
        del rkey, client_ids
        flat, unravel = ravel_pytree(server.params)
        decoded = jax.vmap(decode_float32)(messages)
        mean = weighted_mean(decoded, weights)
        if server_optimizer is None:
            new_flat, opt_state = mean, server.opt_state
        else:
            updates, opt_state = server_optimizer.update(flat - mean, server.opt_state, flat)
            new_flat = optax.apply_updates(flat, updates)
        info = FedAvgServerInfo(update_norm=jnp.linalg.norm(new_flat - flat))
        return FedAvgState(unravel(new_flat), opt_state), info

    round_step = build_round_step(
        broadcast_fn,
        client_update,
        server_update,
        clients_per_round=clients_per_round,
        client_strategy=client_strategy,
        map_batch_size=map_batch_size,
    )
    return Algorithm(init=init, round_step=round_step, eval_params=lambda server: server.params)
