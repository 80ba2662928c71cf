"""LIEC (Cheng et al. 2024, "local immediate error compensation"), the BICompFL paper's bi-directionally
compressed baseline with a periodic full-precision averaging (docs/papers/bicompfl.md#s4-3,
docs/papers/bicompfl.md#liec).

Notation as :mod:`sidejax.algorithms.compressed`: :math:`d` parameters, :math:`C` the compressor (default the
scaled sign, ``32 + d`` bits), :math:`\\eta_S` the server learning rate, :math:`P` the averaging ``period``,
:math:`w` the global model (the server's, and every client's copy of it), :math:`e_i` client :math:`i`'s
compression error, :math:`e_s` the server's. Round :math:`t` is a **sync round** when
:math:`(t + 1) \\bmod P = 0` (public knowledge, as CSER's resets).

Client :math:`i` keeps its own error in its **local model** :math:`x_i = w + e_i` (the immediate compensation:
the part of its last update that the compressor dropped is already applied locally, so its next local
training starts from the compensated point), trains from it to :math:`x_i^{\\mathrm{end}}` and sends

.. math::

    v_i = e_i + \\eta_S (x_i^{\\mathrm{end}} - x_i), \\qquad c_i = C(v_i), \\qquad e_i \\leftarrow v_i - c_i .

The server keeps the one global error variable :math:`e_s`:

.. math::

    u = \\frac1n \\sum_i c_i + e_s, \\qquad \\hat u = C(u), \\qquad e_s \\leftarrow u - \\hat u,
    \\qquad w \\leftarrow w + \\hat u,

and broadcasts :math:`\\hat u` at the start of the next round; every client adds the decoded :math:`\\hat u`
to its copy of :math:`w` (bit for bit the server's, as DoubleSqueeze's). In a sync round both directions
send float32 instead (:math:`c_i = v_i`, :math:`\\hat u = u`), so :math:`e_i = e_s = 0` afterwards and every
local model equals the global model: the full-precision averaging every ``period`` rounds.

The invariant that defines the method: the **virtual model** :math:`\\tilde x = w + e_s + \\frac1n \\sum_i
e_i` moves exactly as uncompressed FedAvg with server step :math:`\\eta_S` on the clients' local updates,

.. math::

    \\tilde x \\leftarrow \\tilde x + \\frac{\\eta_S}{n} \\sum_i (x_i^{\\mathrm{end}} - x_i),

(substitute the updates above: :math:`w + \\hat u + (u - \\hat u) + \\frac1n\\sum_i (v_i - c_i)`), so the
compensated models differ from the uncompressed one only by the errors they carry, and a sync round sets
:math:`w = \\tilde x`. Against DoubleSqueeze (same two error memories): DoubleSqueeze's clients train from
:math:`w` and add :math:`e_i` to their *next* update (delayed compensation); LIEC's train from :math:`w +
e_i`.

What the spec leaves open and what is chosen here ([A], docs/papers/bicompfl.md#liec): the paper's algorithm
is a parameter-server SGD; in the BICompFL setting a local epoch of Adam replaces its gradient step, so
:math:`\\eta_S` scales the local update on the client (as :func:`sidejax.algorithms.cser`), which keeps the
invariant exact; the averaging is the float32 exchange above (one float32 uplink per client in a sync round
and one float32 broadcast after it). Bits, read from the messages: ``32 + d`` each way per round, ``32 d`` in
a sync round (uplink) and in the round after it (downlink); 1 + 31/P bits per parameter each way over a long
run (1.62 at P = 50). Needs full participation (the broadcast carries model *changes*).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.compressed import (
    CompressedClientExtra,
    CompressedClientState,
    CompressedReceived,
    CompressedServerInfo,
    CompressedState,
    ErrorFeedbackMethod,
    _fit,
    _flat,
    _method,
    _reset_round,
    _server_keys,
    _sum_parts,
    compress,
    compressed_algorithm,
    compressed_init,
    decompress,
    message_bits,
)
from sidejax.bits import as_bits
from sidejax.coding.base import ERR_PARSE, Coder, Message, decode_float32, encode_float32, included
from sidejax.coding.bitstream import mask_to_length, sent_words
from sidejax.fl.base import Algorithm, ClientInfo
from sidejax.fl.local import LocalTraining
from sidejax.keys import SERVER, ClientKeys, client_streams, stream_key
from sidejax.types import Params
from sidejax.utils import check_count

__all__ = [
    "liec_capacity",
    "liec_message",
    "liec_decode",
    "liec_init",
    "liec_receive",
    "liec_client_update",
    "liec_server_update",
    "liec",
]


def liec_capacity(coder: Coder, dim: int) -> int:
    """The payload words of every LIEC message: room for a float32 vector (``dim`` words) or one message of
    ``coder``, whichever is longer."""
    return max(int(dim), sent_words(message_bits(coder, dim)))


def liec_message(coder: Coder, keys: ClientKeys, v: jax.Array, full: jax.Array):
    """``v`` as float32 (``full``: a sync round; 32 bits per coordinate, decoded exactly) or compressed
    (:func:`sidejax.algorithms.compressed.compress`): ``(message, decoded, valid)``, the message in a
    :func:`liec_capacity` payload, ``decoded`` what every receiver decodes from it, bit for bit."""
    dim = v.shape[0]
    capacity = liec_capacity(coder, dim)
    packed, c, valid = compress(coder, keys, v, 1)
    exact = encode_float32(v)
    payload = jnp.where(full, _fit(exact.payload, capacity), _fit(packed.payload, capacity))
    num_bits = jnp.where(full, as_bits(exact.num_bits), as_bits(packed.num_bits))
    decoded = jnp.where(full, v, c)
    return Message(payload, num_bits), decoded, jnp.where(full, jnp.all(jnp.isfinite(v)), valid)


def liec_decode(coder: Coder, shared_key, message: Message, dim: int, full: jax.Array):
    """The receiver's side of :func:`liec_message`: ``(decoded, errors)``; ``full`` (public: whether the
    message belongs to a sync round) selects the float32 reading, else the compressor's. ``errors`` flags
    ``ERR_PARSE`` when the length is not the one ``full`` implies."""
    c, c_errors = decompress(coder, shared_key, message, dim, 1)
    words = jnp.asarray(message.payload, jnp.uint32)
    exact_words, ok = mask_to_length(_fit(words, dim), message.num_bits, num_sent_words=words.shape[0])
    ok = ok & (as_bits(message.num_bits) == 32 * dim)
    exact = decode_float32(Message(exact_words, message.num_bits))
    errors = jnp.where(full, jnp.where(ok, 0, ERR_PARSE), c_errors).astype(jnp.int32)
    return jnp.where(full, exact, c), errors


def liec_init(method: ErrorFeedbackMethod, key, params: Params, num_clients: int):
    """DoubleSqueeze's initial state (:func:`sidejax.algorithms.compressed.compressed_init`: every client's
    copy of the initial model, zero errors, the first broadcast :math:`C(0)`) with the broadcast in a
    :func:`liec_capacity` payload. Raises ``ValueError`` without full participation."""
    state = compressed_init(method, key, params, num_clients)
    dim = state.clients.error.shape[1]
    message = state.server.downlink
    padded = Message(_fit(message.payload, liec_capacity(method.coder, dim)), message.num_bits)
    return state._replace(server=state.server._replace(downlink=padded))


def liec_receive(
    method: ErrorFeedbackMethod, dkey, keys, server: CompressedState, cstate: CompressedClientState, message
) -> CompressedReceived:
    """A client adds the decoded step to its copy of :math:`w` (float32 after a sync round); ``reset`` says
    whether this round is a sync round."""
    del keys
    flat, unravel = ravel_pytree(server.params)
    after_sync = (server.rounds > 0) & _reset_round(method, server.rounds - 1)
    step, errors = liec_decode(method.coder, dkey, message, flat.shape[0], after_sync)
    return CompressedReceived(unravel(cstate.model + step), errors, _reset_round(method, server.rounds))


def liec_client_update(
    method: ErrorFeedbackMethod,
    local_train: Callable,
    keys: ClientKeys,
    received: CompressedReceived,
    cstate: CompressedClientState,
    data,
):
    """One client: trains from its local model :math:`x_i = w + e_i`, sends :math:`v_i = e_i + \\eta_S
    (x_i^{\\mathrm{end}} - x_i)` (compressed, or float32 in a sync round) and keeps
    :math:`e_i = v_i - c_i`."""
    train_key, sample_key = client_streams(keys.private)
    held, unravel = ravel_pytree(received.params)
    start = held + cstate.error
    params, info = local_train(train_key, unravel(start), data)
    vector = cstate.error + method.server_lr * (_flat(params) - start)
    message, c, valid = liec_message(
        method.coder, ClientKeys(keys.shared, sample_key), vector, received.reset
    )
    error = vector - c
    finite = info.finite & jnp.all(jnp.isfinite(vector)) & jnp.all(jnp.isfinite(error))
    extra = CompressedClientExtra(info.num_steps, jnp.linalg.norm(error), received.errors)
    cinfo = ClientInfo(loss=info.loss, finite=finite, extra=extra, valid=valid & (received.errors == 0))
    return CompressedClientState(held, error), message, cinfo


def liec_server_update(
    method: ErrorFeedbackMethod, rkey, server: CompressedState, client_ids, shared_keys, messages, weights
):
    """The server: the unweighted mean :math:`\\bar c` of the included uplinks (zero with none, so every party
    stays bit-identical), :math:`u = \\bar c + e_s`, the next broadcast :math:`C(u)` (float32 :math:`u` in a
    sync round), :math:`e_s \\leftarrow u - \\hat u`, :math:`w \\leftarrow w + \\hat u`."""
    del client_ids, weights  # the unweighted 1/|S_t| mean [P]
    flat, unravel = ravel_pytree(server.params)
    dim = flat.shape[0]
    sync = _reset_round(method, server.rounds)
    decoded, errors = jax.vmap(lambda k, m: liec_decode(method.coder, k, m, dim, sync))(shared_keys, messages)
    include = included(messages, errors == 0)
    # summed in the participants' order (one lax.scan, as _sum_parts): the same bits in any compiled program
    # (a sharded run's server too), since the scale of C(u) depends on every bit of u
    count = jnp.sum(include).astype(decoded.dtype)
    total = _sum_parts(jnp.where(include[:, None], decoded, 0.0))
    mean = jnp.where(count > 0, total / jnp.maximum(count, 1.0), jnp.zeros((), decoded.dtype))
    u = mean + server.residual
    keys = _server_keys(stream_key(rkey, SERVER))
    downlink, step, downlink_valid = liec_message(method.coder, keys, u, sync)
    residual = u - step
    new = flat + step
    info = CompressedServerInfo(jnp.linalg.norm(new - flat), jnp.linalg.norm(residual), downlink_valid)
    return CompressedState(unravel(new), residual, downlink, server.rounds + 1), info, errors


def liec_algorithm(method: ErrorFeedbackMethod, loss_fn: Callable, local: LocalTraining) -> Algorithm:
    """The :class:`sidejax.fl.Algorithm` of LIEC (``method.reset_period``: the averaging period):
    DoubleSqueeze's (:func:`sidejax.algorithms.compressed.compressed_algorithm`: its broadcast, evaluation and
    metrics) with LIEC's initial state, receiver, client and server."""
    return compressed_algorithm(method, loss_fn, local)._replace(
        init=functools.partial(liec_init, method),
        receive=functools.partial(liec_receive, method),
        client_update=functools.partial(liec_client_update, method, local.trainer(loss_fn)),
        server_update=functools.partial(liec_server_update, method),
    )


def liec(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.1,
    period: int = 50,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds LIEC (Cheng et al. 2024): local immediate error compensation, the server's error feedback,
    compressed both ways (~1 bit per parameter with the scaled sign), float32 averaging every ``period``
    rounds. Needs full participation (checked by ``init``).

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      local: the clients' training ([P]: Adam 3e-4, 3 epochs, batch 128).
      clients_per_round: participants per round (all clients).
      server_lr: :math:`\\eta_S` ([P]: 0.1), applied to the local update on the client.
      period: rounds between the full-precision averagings (>= 1; [P]: 50).
      coder: the compressor (default :func:`sidejax.coding.scaled_sign_coder`; deterministic, fixed length).
    """
    period = check_count(period, "period", 1)
    method = _method("liec", coder, server_lr, clients_per_round, downlink_rounds=1, reset_period=period)
    return liec_algorithm(method, loss_fn, local)
