"""Federated Averaging (McMahan et al., 2017), uncompressed: the reference baseline.

Round ``t`` with participants :math:`S_t` and example counts :math:`n_i`:

.. math::

    w_i^{t+1} = \\mathrm{LocalOpt}_i(w^t), \\qquad
    \\bar w^{t+1} = \\sum_{i \\in S_t} \\frac{n_i}{\\sum_{j \\in S_t} n_j} \\, w_i^{t+1}

With ``server_optimizer=None`` the server takes :math:`w^{t+1} = \\bar w^{t+1}`. With a server optimizer
(FedOpt, Reddi et al. 2021) it steps on the pseudo-gradient :math:`w^t - \\bar w^{t+1}` instead.

Bits: the downlink sends :math:`w^t` as float32 words (:func:`sidejax.coding.encode_float32`) and each
client sends a sample of the point mass at :math:`w_i^{t+1}` with ``coder`` (default
:func:`sidejax.coding.float32_coder`: 32 bits per parameter, measured from the payload). The clients use
the *decoded* downlink message, and the server averages the *decoded* uplink messages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import receive_vector, vector_downlink
from sidejax.coding.base import (
    Coder,
    EmptyState,
    Message,
    float32_coder,
    included,
)
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundState, initial_round_state
from sidejax.fl.local import LocalTraining
from sidejax.keys import ClientKeys, client_streams
from sidejax.types import Params
from sidejax.utils import keep_unless_none, masked_mean

__all__ = [
    "FedAvgState",
    "FedAvgServerInfo",
    "weighted_mean",
    "fedavg_init",
    "fedavg_broadcast",
    "fedavg_receive",
    "upload_params",
    "fedavg_client_update",
    "fedavg_server_update",
    "fedavg",
]


class FedAvgState(NamedTuple):
    """Server state: the global parameters, the server optimizer's state (``EmptyState`` if none) and the
    coder's protocol state."""

    params: Params
    opt_state: optax.OptState
    coder: object = EmptyState()


class FedAvgServerInfo(NamedTuple):
    """Server diagnostics: the global norm of the round's model change."""

    update_norm: jax.Array


def weighted_mean(values: jax.Array, weights: jax.Array, include: jax.Array | None = None) -> jax.Array:
    """Mean of ``values[clients, ...]`` with weights normalised to sum to 1 (exact for a single client), over
    the ``include``-d clients alone (all by default; :func:`sidejax.utils.masked_mean`)."""
    values = jnp.asarray(values)
    include = jnp.ones(values.shape[:1], bool) if include is None else include
    return masked_mean(values, include, weights)


def fedavg_init(server_optimizer, coder: Coder, key, params: Params, num_clients: int) -> RoundState:
    """The initial state: the global model, the server optimizer's state, the coder's state."""
    del key  # FedAvg clients hold no state
    flat = ravel_pytree(params)[0]
    opt_state = server_optimizer.init(flat) if server_optimizer is not None else EmptyState()
    state = FedAvgState(params, opt_state, coder.init(flat.shape[0]))
    return initial_round_state(state, EmptyState(), num_clients)


def fedavg_broadcast(coder: Coder, key, server: FedAvgState, client_ids) -> tuple[FedAvgState, Message]:
    """The downlink: the global model as float32, then the coder's protocol stream (server unchanged)."""
    del key, client_ids
    return server, vector_downlink(ravel_pytree(server.params)[0], coder, server.coder)


def fedavg_receive(coder: Coder, dkey, keys, server: FedAvgState, cstate, message: Message) -> FedAvgState:
    """The clients' decoding of :func:`fedavg_broadcast`."""
    del dkey, keys, cstate
    flat, unravel = ravel_pytree(server.params)
    received, _, cstate = receive_vector(message, flat.shape[0], coder, server.coder)
    return server._replace(params=unravel(received), coder=cstate)


def upload_params(coder: Coder, keys: ClientKeys, server: FedAvgState, params: Params):
    """A client's upload of its local model ``params``: the point mass at it through ``coder``, against the
    point mass at the received global model, with the client's ``SAMPLE`` stream as the private key.

    Returns:
      ``(message, coder info)``.
    """
    p = PointMass(ravel_pytree(server.params)[0])
    sample_keys = ClientKeys(keys.shared, client_streams(keys.private).sample)
    return coder.encode(sample_keys, PointMass(ravel_pytree(params)[0]), p, server.coder)


def fedavg_client_update(local_train, coder: Coder, keys: ClientKeys, server: FedAvgState, state, data):
    """One client: local training from the received model, then its point mass through ``coder``."""
    params, info = local_train(client_streams(keys.private).train, server.params, data)
    message, cinfo = upload_params(coder, keys, server, params)
    return (
        state,
        message,
        ClientInfo(loss=info.loss, finite=info.finite, extra=info.num_steps, valid=cinfo.valid),
    )


def fedavg_server_update(
    server_optimizer, coder: Coder, rkey, server: FedAvgState, client_ids, shared_keys, messages, weights
):
    """The server: decode, example-weighted mean over the included participants
    (:func:`sidejax.coding.included`), then plain averaging or a FedOpt step; with none included the state is
    kept."""
    del rkey, client_ids
    flat, unravel = ravel_pytree(server.params)
    p = PointMass(flat)
    decoded, checks = jax.vmap(coder.decode, (0, None, None, 0))(shared_keys, p, server.coder, messages)
    include = included(messages, checks.valid)
    cstate, _ = coder.update(server.coder, checks._replace(valid=include))
    weights = jnp.ones(include.shape, jnp.float32) if weights is None else weights
    mean = weighted_mean(decoded, weights, include)
    if server_optimizer is None:
        new_flat, opt_state = mean, server.opt_state
    else:
        updates, opt_state = server_optimizer.update(flat - mean, server.opt_state, flat)
        new_flat = optax.apply_updates(flat, updates)
    new = server._replace(params=unravel(new_flat), opt_state=opt_state, coder=cstate)
    new = keep_unless_none(include, new, server)
    info = FedAvgServerInfo(update_norm=jnp.linalg.norm(ravel_pytree(new.params)[0] - flat))
    return new, info, checks.errors


def fedavg(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_optimizer: optax.GradientTransformation | None = None,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds FedAvg.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> scalar`` (see :mod:`sidejax.fl.local`).
      local: the clients' training (:class:`sidejax.fl.LocalTraining`: optimizer, batch size, epochs or
        steps).
      clients_per_round: participants per round.
      server_optimizer: optional FedOpt server optimizer on the pseudo-gradient; ``None`` = plain averaging.
      coder: the uplink coder of the local model (``q`` its point mass, ``p`` the point mass at the global
        model); default :func:`sidejax.coding.float32_coder`.

    Returns:
      An :class:`sidejax.fl.Algorithm`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from sidejax.algorithms import fedavg
      >>> from sidejax.fl import LocalTraining
      >>> loss = lambda p, b, k: jnp.sum(b.mask * (b.x[:, 0] * p["w"] - b.y) ** 2) / b.mask.sum()
      >>> algo = fedavg(loss, LocalTraining(optax.sgd(0.1), batch_size=4), clients_per_round=2)
      >>> state = algo.init(jax.random.key(0), {"w": jnp.zeros(())}, 3)
      >>> int(state.round_index)
      0
    """
    coder = float32_coder() if coder is None else coder
    return Algorithm(
        init=functools.partial(fedavg_init, server_optimizer, coder),
        broadcast=functools.partial(fedavg_broadcast, coder),
        receive=functools.partial(fedavg_receive, coder),
        client_update=functools.partial(fedavg_client_update, local.trainer(loss_fn), coder),
        server_update=functools.partial(fedavg_server_update, server_optimizer, coder),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=clients_per_round,
    )
