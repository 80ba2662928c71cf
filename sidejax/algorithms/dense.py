"""The shared skeleton of the dense compressed methods: train, code the update, average, server step.

QSGD, SignSGD and the Langevin methods (QLSD, SGLD-KLMS) differ only in a few pure functions, gathered in a
:class:`DenseMethod`; the coder (:class:`sidejax.coding.Coder`) is an argument, so a method's vanilla and KLMS
variants are the same builder with two coders. Round ``t``:

- **downlink**: the global parameters as float32, then the method's prior side information when the coder
  decodes with ``p`` (:attr:`sidejax.coding.Coder.uses_prior`), then the coder's protocol stream, in one
  message (:func:`sidejax.coding.concat_messages`); every client decodes it (:func:`receive`);
- **client** (:func:`client_update`): ``v = direction(train_key, params, data)`` (a model change or a
  gradient), ``q = law(v)``, ``p = prior(prior_state)``, and the message
  ``coder.encode(ClientKeys(shared, sample_key), q, p, coder_state)``;
- **server** (:func:`server_update`): decode every message with the participant's shared key (from the
  engine), ``vhat = reconstruct(samples)``, ``params = server_step(key, params, vhat, weights)``, the
  prior's and the coder's protocol updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.coding.base import (
    Coder,
    EmptyState,
    Message,
    concat_after_float32,
    decode_float32,
    empty_message,
    included,
    split_message,
)
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundInfo, RoundState, initial_round_state
from sidejax.keys import SERVER, ClientKeys, client_streams, stream_key
from sidejax.layout import FlatLayout, flat_layout
from sidejax.types import Params
from sidejax.utils import keep_unless_none

__all__ = [
    "DenseState",
    "DenseClientExtra",
    "DenseServerInfo",
    "DenseMethod",
    "vector_downlink",
    "receive_vector",
    "dense_broadcast",
    "dense_receive",
    "dense_client_update",
    "dense_server_update",
    "dense_algorithm",
    "coder_metrics",
]


class DenseState(NamedTuple):
    """Server state of a dense method.

    Attributes:
      params: the global model.
      prior: the method's side-information state behind ``p`` (e.g. QSGD-KLMS's symbol counts;
        ``EmptyState``).
      coder: the coder's protocol state (``EmptyState`` for stateless coders).
    """

    params: Params
    prior: Any
    coder: Any


class DenseClientExtra(NamedTuple):
    """Per-client diagnostics: ``ideal_bits`` (the coder's ideal rate, NaN if none) and the coder's info."""

    ideal_bits: jax.Array
    coder: Any


class DenseServerInfo(NamedTuple):
    """``update_norm``: norm of the server's model change; ``coder``: the coder's protocol diagnostics."""

    update_norm: jax.Array
    coder: Any


class DenseMethod(NamedTuple):
    """The pure functions that make a dense method (all but ``server_step`` run on the clients too).

    Attributes:
      direction: ``direction(train_key, params, data) -> (v_flat, loss, finite)``.
      law: ``law(v_flat, layout) -> q`` (a distribution over the flat vector, or ``(q, side)`` with a
        side-info coder; ``layout`` is the :class:`sidejax.layout.FlatLayout` of the parameters).
      prior: ``prior(prior_state, layout) -> p``.
      reconstruct: ``reconstruct(samples, layout) -> vhat`` for the stacked decoded samples.
      server_step: ``server_step(server_key, flat_params, vhat[clients, dim], include[clients]) ->
        flat_params``: ``include`` marks the participants that count (:func:`sidejax.coding.included`);
        the rows of the others are garbage and must not reach the result (renormalise over the included
        ones, :func:`sidejax.utils.masked_mean`). Not called with none included (the state is kept).
      init_prior: ``init_prior(layout) -> prior_state``.
      update_prior: ``update_prior(prior_state, samples, include) -> prior_state`` (after every round with a
        participant included; ``include`` as in ``server_step``).
      prior_downlink: ``prior_downlink(prior_state) -> Message``: what the receivers need to rebuild ``p``
        (sent only when the coder decodes with ``p``); ``prior_bits`` its static length.
      prior_receive: ``prior_receive(prior_state, message) -> prior_state``.
      wrap_coder: ``wrap_coder(coder, layout) -> coder``: e.g. :func:`sidejax.coding.with_side_info` for
        per-tensor side information (identity by default).
    """

    direction: Callable
    law: Callable
    prior: Callable
    reconstruct: Callable
    server_step: Callable
    init_prior: Callable = lambda layout: EmptyState()
    update_prior: Callable = lambda prior_state, samples, include: prior_state
    prior_downlink: Callable = lambda prior_state: empty_message()
    prior_receive: Callable = lambda prior_state, message: prior_state
    prior_bits: Callable = lambda prior_state: 0
    wrap_coder: Callable = lambda coder, layout: coder


def _coder(method: DenseMethod, coder: Coder, params: Params) -> tuple[Coder, FlatLayout]:
    layout = flat_layout(params)
    return method.wrap_coder(coder, layout), layout


def vector_downlink(flat: jax.Array, coder: Coder, coder_state, *middle: Message) -> Message:
    """The downlink of a method that broadcasts one float vector (the model, FedPM's mask probabilities):
    the vector as float32 words, then ``middle`` (e.g. a prior's side information), then the coder's
    protocol stream, in one message."""
    return concat_after_float32(flat, *middle, coder.downlink(coder_state))


def receive_vector(message: Message, dim: int, coder: Coder, coder_state, middle_bits: tuple[int, ...] = ()):
    """The receivers' side of :func:`vector_downlink`: ``(vector, middle_messages, coder_state)``; the middle
    parts have the static lengths ``middle_bits``."""
    parts = split_message(message, (32 * dim, *middle_bits))
    return decode_float32(parts[0]), parts[1:-1], coder.receive(coder_state, parts[-1])


def dense_broadcast(method: DenseMethod, coder: Coder, server: DenseState) -> Message:
    """The downlink: float32 parameters, the prior side information (if the coder uses ``p``), the coder's
    protocol stream."""
    coder, _ = _coder(method, coder, server.params)
    middle = (method.prior_downlink(server.prior),) if coder.uses_prior else ()
    return vector_downlink(ravel_pytree(server.params)[0], coder, server.coder, *middle)


def dense_receive(method: DenseMethod, coder: Coder, server: DenseState, message: Message) -> DenseState:
    """The clients' decoding of :func:`dense_broadcast` (the server state stands for what a client already
    knows: the shapes, and the protocol state of earlier rounds)."""
    coder, layout = _coder(method, coder, server.params)
    middle = (method.prior_bits(server.prior),) if coder.uses_prior else ()
    flat, parts, cstate = receive_vector(message, layout.dim, coder, server.coder, middle)
    prior = method.prior_receive(server.prior, parts[0]) if coder.uses_prior else server.prior
    return DenseState(ravel_pytree(server.params)[1](flat), prior, cstate)


def dense_client_update(method: DenseMethod, coder: Coder, keys: ClientKeys, server: DenseState, state, data):
    """One client: direction, law, and the coder's message (the sample is drawn from the private key's
    sample stream, :func:`sidejax.keys.client_streams`)."""
    coder, layout = _coder(method, coder, server.params)
    train_key, sample_key = client_streams(keys.private)
    v, loss, finite = method.direction(train_key, server.params, data)
    q = method.law(v, layout)
    p = method.prior(server.prior, layout)
    message, cinfo = coder.encode(ClientKeys(keys.shared, sample_key), q, p, server.coder)
    extra = DenseClientExtra(jnp.asarray(cinfo.ideal_bits, jnp.float32), cinfo)
    info = ClientInfo(loss=loss, finite=finite & jnp.all(jnp.isfinite(v)), extra=extra, valid=cinfo.valid)
    return state, message, info


def dense_server_update(
    method: DenseMethod, coder: Coder, rkey, server: DenseState, shared_keys, messages, weights
):
    """The server: decode each participant with its shared key, reconstruct, step, update prior and coder,
    over the included participants (:func:`sidejax.coding.included`); with none included the state is
    kept."""
    del weights  # the dense methods average uniformly [P]; server_step sees who is included
    coder, layout = _coder(method, coder, server.params)
    flat, unravel = ravel_pytree(server.params)
    p = method.prior(server.prior, layout)
    samples, decoded = jax.vmap(coder.decode, (0, None, None, 0))(shared_keys, p, server.coder, messages)
    include = included(messages, decoded.valid)
    vhat = method.reconstruct(samples, layout)
    new_flat = method.server_step(stream_key(rkey, SERVER), flat, vhat, include)
    prior = method.update_prior(server.prior, samples, include)
    cstate, cinfo = coder.update(server.coder, decoded._replace(valid=include))
    new = keep_unless_none(include, DenseState(unravel(new_flat), prior, cstate), server)
    info = DenseServerInfo(update_norm=jnp.linalg.norm(ravel_pytree(new.params)[0] - flat), coder=cinfo)
    return new, info, decoded.errors


def coder_metrics(info: RoundInfo) -> dict:
    """The metrics hook of coder-based methods: the mean ideal rate per participant (``ideal_bits``, NaN
    for coders without one)."""
    return {"ideal_bits": jnp.mean(info.clients.extra.ideal_bits, axis=-1)}


def dense_algorithm(
    method: DenseMethod,
    coder: Coder,
    *,
    clients_per_round: int,
    check_num_clients: int | None = None,
) -> Algorithm:
    """The :class:`sidejax.fl.Algorithm` of a dense method with a coder."""
    if not isinstance(coder, Coder):
        raise TypeError(f"coder must be a sidejax.coding.Coder, got {type(coder).__name__}")

    def init(key, params: Params, num_clients: int) -> RoundState:
        del key
        if check_num_clients is not None and num_clients != check_num_clients:
            raise ValueError(
                f"the algorithm was built for num_clients={check_num_clients} but the data has "
                f"{num_clients} clients"
            )
        layout = flat_layout(params)
        server = DenseState(params, method.init_prior(layout), coder.init(layout.dim))
        return initial_round_state(server, EmptyState(), num_clients)

    return Algorithm(
        init=init,
        broadcast=lambda key, server, ids: (server, dense_broadcast(method, coder, server)),
        receive=lambda dkey, keys, server, cstate, message: dense_receive(method, coder, server, message),
        client_update=lambda keys, server, state, data: dense_client_update(
            method, coder, keys, server, state, data
        ),
        server_update=lambda rkey, server, ids, shared, msgs, w: dense_server_update(
            method, coder, rkey, server, shared, msgs, w
        ),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=clients_per_round,
        metrics=coder_metrics,
    )
