"""The non-stochastic bi-directionally compressed baselines of the BICompFL paper
(docs/papers/bicompfl.md#s4-1, docs/papers/bicompfl.md#s4-3): Mem-SGD,
DoubleSqueeze, Neolithic and CSER, each with error feedback and a deterministic compressor.

Notation: :math:`d` parameters, :math:`S_t` the participants of round :math:`t`, :math:`\\eta_S` the
server learning rate, :math:`C` the compressor (default :func:`sidejax.coding.scaled_sign_coder`,
:math:`C(v) = (\\|v\\|_1/d)\\,\\mathrm{sign}(v)`, ``32 + d`` bits), and :math:`C_R` its :math:`R`-round
residual version (Neolithic's compressor)

.. math::

    c_0 = 0, \\qquad c_r = c_{r-1} + C(v - c_{r-1}), \\qquad C_R(v) = c_R,

sent as the :math:`R` messages of :math:`C` back to back (``R (32 + d)`` bits; :math:`C_1 = C`). Every
client trains locally (:class:`sidejax.fl.LocalTraining`) from the model it holds, :math:`w_i`, and forms
:math:`\\Delta_i = w_i^{\\mathrm{end}} - w_i`. The server averages the decoded uplinks with the unweighted
mean :math:`\\bar c = \\frac1{|S_t|}\\sum_{i \\in S_t} c_i` (docs/papers/bicompfl.md#s8-16).

- **Mem-SGD** (Stich et al. 2018; :func:`memsgd`): client error feedback :math:`v_i = \\Delta_i + e_i`,
  :math:`c_i = C(v_i)`, :math:`e_i \\leftarrow v_i - c_i`; server :math:`w \\leftarrow w + \\eta_S \\bar c`.
  Downlink: :math:`w` as float32 (32 bits per parameter). Uplink: one message of :math:`C` (~1 bit).
- **DoubleSqueeze** (Tang et al. 2019; :func:`doublesqueeze`): the clients as in Mem-SGD; the server
  compresses its step with its own error feedback :math:`e_s`:
  :math:`u = \\eta_S \\bar c + e_s`, :math:`\\hat u = C(u)`, :math:`e_s \\leftarrow u - \\hat u`,
  :math:`w \\leftarrow w + \\hat u`, and broadcasts :math:`\\hat u` (~1 bit per parameter). Every client
  adds the decoded :math:`\\hat u` to its own copy of the model. (Tang et al. compress the averaged gradient
  and step by :math:`\\gamma`; because :math:`C` is positively homogeneous, :math:`C(\\gamma x) = \\gamma
  C(x)`, compressing the step itself is the same method with :math:`e_s` measured in step units.)
- **Neolithic** (Huang et al. 2022; :func:`neolithic`), as docs/papers/bicompfl.md#s4-3 sketches it:
  DoubleSqueeze with :math:`C_R` in both directions (``compress_rounds = R``, ~``R`` bits per parameter each
  way).
- **CSER** (Xie et al. 2020; :func:`cser`), CSER-PSync in a server/client form: each client's local model
  is :math:`x_i = w + e_i`, the global model plus the residual it has not shared. A client trains from
  :math:`x_i`, takes the step :math:`\\delta_i = \\eta_S \\Delta_i`, sends :math:`c_i = C(\\delta_i)` and
  keeps the rest, :math:`e_i \\leftarrow e_i + (\\delta_i - c_i)`; the server sets
  :math:`w \\leftarrow w + \\bar c` and broadcasts :math:`w` as float32. Every ``period``-th round ends
  with an **error reset**: each participant also sends :math:`c'_i = C(e_i)` and keeps
  :math:`e_i \\leftarrow e_i - c'_i`, and the server adds :math:`\\frac1{|S_t|}\\sum c'_i` to :math:`w`
  (CSER's second, compressed all-reduce of the residuals). Uplink: one message, two in reset rounds
  (:math:`\\approx 1 + 1/\\mathrm{period}` bits per parameter); downlink 32. The paper's tables print DL 33
  for some datasets (docs/papers/bicompfl.md#s8-15), consistent with a second float32 downlink in reset
  rounds; here the reset is folded into the next model broadcast, so DL stays 32.

Timing of a compressed downlink (DoubleSqueeze, Neolithic): the server compresses its step at the end of
round :math:`t` (so the model it evaluates, :attr:`CompressedState.params`, includes round :math:`t`) and
the message is broadcast at the start of round :math:`t + 1`, before the clients train. Server and clients
both apply it as ``w + decode(message)`` with the decoder's exact reconstruction (a float32 scale times
``±1``, summed over the ``R`` parts in order), so every client's copy equals the server's model bit for bit.
A client that missed a broadcast would miss a step and drift, so these two methods need full participation.
Round 0's broadcast carries :math:`C_R(0) = 0`; the initial model itself is not sent
(docs/papers/bicompfl.md#s8-17).

Compressors: a coder of point masses (:class:`sidejax.distributions.PointMass`) that is deterministic
(its message does not depend on the keys: the server compresses in one round's update and the clients
decode in the next round's broadcast) and writes streams whose length depends only on ``d`` (the receiver
cuts the ``R`` parts at multiples of it). :func:`sidejax.coding.scaled_sign_coder` (the default) and
:func:`sidejax.coding.float32_coder` (error feedback without compression) qualify; the builders read both
properties from the coder's declared fields (``deterministic``, ``fixed_bits``; :func:`check_compressor`).
Every bit count in :class:`sidejax.fl.RoundInfo` is read from the messages.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.bits import BITS_DTYPE, as_bits
from sidejax.coding.base import (
    ERR_LENGTH,
    ERR_PARSE,
    Coder,
    EmptyState,
    Message,
    concat_stacked,
    decode_float32,
    encode_float32,
    included,
)
from sidejax.coding.bitstream import mask_to_length, sent_words, unpack_fixed
from sidejax.coding.compress import scaled_sign_coder
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundInfo, RoundState, initial_round_state
from sidejax.fl.local import LocalTraining
from sidejax.fl.roles import track_rounds
from sidejax.keys import SERVER, ClientKeys, client_streams, stream_key
from sidejax.types import Params
from sidejax.utils import check_count, masked_mean

__all__ = [
    "ErrorFeedbackMethod",
    "CompressedState",
    "CompressedClientState",
    "CompressedReceived",
    "CompressedClientExtra",
    "CompressedServerInfo",
    "check_compressor",
    "message_bits",
    "compress",
    "decompress",
    "compressed_init",
    "compressed_broadcast",
    "compressed_receive",
    "compressed_client_update",
    "compressed_server_update",
    "compressed_metrics",
    "compressed_algorithm",
    "memsgd",
    "doublesqueeze",
    "neolithic",
    "cser",
]


class ErrorFeedbackMethod(NamedTuple):
    """The static description of an error-feedback method (what the kernels branch on, at trace time).

    Attributes:
      name: the method's name (for error messages).
      coder: the compressor's coder (deterministic, fixed length: :func:`check_compressor`).
      server_lr: :math:`\\eta_S > 0`.
      clients_per_round: participants per round.
      uplink_rounds: :math:`R` of the clients' compressor :math:`C_R` (1: :math:`C`).
      downlink_rounds: 0 for a float32 model downlink (Mem-SGD, CSER); :math:`R \\ge 1` for the server's
        error-compensated step through :math:`C_R` (DoubleSqueeze: 1, Neolithic: ``compress_rounds``).
      reset_period: 0 for client error feedback on the update (Mem-SGD, DoubleSqueeze, Neolithic); CSER's
        error-reset period (>= 1) otherwise (LIEC, :mod:`sidejax.algorithms.liec`: its averaging period).
    """

    name: str
    coder: Coder
    server_lr: float
    clients_per_round: int
    uplink_rounds: int = 1
    downlink_rounds: int = 0
    reset_period: int = 0


class CompressedState(NamedTuple):
    """Server state.

    Attributes:
      params: the server's model :math:`w` (what is evaluated).
      residual: the server's error-feedback memory :math:`e_s` ``[d]`` (``EmptyState`` with a float32
        downlink).
      downlink: the compressed step to broadcast at the start of the next round (a :class:`Message` of
        ``downlink_rounds`` parts; ``EmptyState`` with a float32 downlink).
      rounds: int32, rounds completed (CSER's reset schedule: public knowledge).
    """

    params: Params
    residual: jax.Array | EmptyState
    downlink: Message | EmptyState
    rounds: jax.Array


class CompressedClientState(NamedTuple):
    """Client state (stacked over all clients).

    Attributes:
      model: this client's own copy of the global model ``[d]`` (compressed downlink), else ``EmptyState``.
      error: the client's error-feedback memory :math:`e_i` ``[d]`` (CSER: the residual its local model
        holds beyond the global model).
    """

    model: jax.Array | EmptyState
    error: jax.Array


class CompressedReceived(NamedTuple):
    """What a client decoded from the downlink: ``params`` (the model it holds: its updated copy, or the
    float32 global model), ``errors`` (the downlink stream's error bitmask) and ``reset`` (CSER: whether this
    round ends with an error reset; the round number is public)."""

    params: Params
    errors: jax.Array
    reset: jax.Array


class CompressedClientExtra(NamedTuple):
    """Per-client diagnostics: local steps, :math:`\\|e_i\\|_2` after the round, the downlink's error
    bitmask."""

    num_steps: jax.Array
    error_norm: jax.Array
    downlink_errors: jax.Array


class CompressedServerInfo(NamedTuple):
    """Server diagnostics: :math:`\\|w^{t+1} - w^t\\|_2`, :math:`\\|e_s\\|_2` (0 with a float32 downlink), and
    whether the server's own downlink message encoded and decoded cleanly."""

    update_norm: jax.Array
    residual_norm: jax.Array
    downlink_valid: jax.Array


# ---------------------------------------------------------------------------------------------------
# the compressor C_R as messages


def message_bits(coder: Coder, dim: int) -> int:
    """The (static) length of one message of ``coder`` for a vector of ``dim`` coordinates: the coder's
    declared :attr:`sidejax.coding.Coder.fixed_bits` (a compressor's length depends only on ``dim``,
    :func:`check_compressor`). The scaled-sign coder: ``32 + dim``; float32: ``32 dim``."""
    if coder.fixed_bits is None:
        raise ValueError(
            f"coder {coder.name!r} declares no fixed_bits: its message length is not fixed by dim"
        )
    return int(coder.fixed_bits(dim))


def check_compressor(coder: Coder, name: str = "coder") -> Coder:
    """Returns ``coder`` if it can be an error-feedback compressor: a :class:`sidejax.coding.Coder` that
    declares itself ``deterministic`` (its messages of a point mass do not depend on the keys, encode and
    decode) and ``fixed_bits`` (its length does not depend on the values). Both are declared fields of the
    contract, checked against ``encode`` by the family test (tests/coding/test_coders.py); what the decoded
    vector means is not checked. Raises ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if not isinstance(coder, Coder):
        raise TypeError(f"{name} must be a sidejax.coding.Coder, got {type(coder).__name__}")
    if not coder.deterministic:
        problem = (
            "its messages depend on the keys (it declares deterministic=False; a deterministic compressor "
            "is needed)"
        )
    elif coder.fixed_bits is None:
        problem = (
            "its message length depends on the values (it declares no fixed_bits; a fixed length per "
            "dimension is needed)"
        )
    else:
        return coder
    raise ValueError(
        f"{name} {coder.name!r} cannot be an error-feedback compressor: {problem}; use "
        "sidejax.coding.scaled_sign_coder() or float32_coder()"
    )


def _fit(words, capacity: int) -> jax.Array:
    words = jnp.asarray(words, jnp.uint32)
    return jnp.pad(words, (0, max(0, capacity - words.shape[0])))[:capacity]


def _encode_parts(coder: Coder, keys: ClientKeys, v: jax.Array, rounds: int):
    """The ``rounds`` messages of :math:`C_R(v)` stacked (payload ``[rounds, words]``), :math:`C_R(v)` as the
    receivers will decode it (each part decoded from its message, summed in order from 0 as
    :func:`decompress` does: the same float32 operations on the same bits) and whether every part encoded
    validly at the expected length."""
    dim = v.shape[0]
    bits = message_bits(coder, dim)
    p = PointMass(jnp.zeros(dim, jnp.float32))
    state = coder.init(dim)

    def step(c, _):
        message, info = coder.encode(keys, PointMass(v - c), p, state)
        message = Message(_fit(message.payload, sent_words(bits)), as_bits(message.num_bits))
        part, check = coder.decode(keys.shared, p, state, message)
        valid = jnp.asarray(info.valid) & (message.num_bits == bits) & (check.errors == 0)
        return c + part, (message, valid)

    c, (parts, valid) = jax.lax.scan(step, jnp.zeros(dim, jnp.float32), None, length=rounds)
    return parts, c, jnp.all(valid)


def _join(parts: Message, keep: jax.Array | None, capacity_parts: int, bits: int) -> Message:
    """The stacked parts back to back at bit precision (``keep``: which to send), in a payload of exactly
    ``ceil(capacity_parts * bits / 32)`` words."""
    if parts.payload.shape[0] == 1 and keep is None:
        return Message(parts.payload[0], parts.num_bits[0])
    joined = concat_stacked(parts, keep)
    return Message(_fit(joined.payload, sent_words(capacity_parts * bits)), joined.num_bits)


def _split(message: Message, rounds: int, bits: int) -> tuple[Message, jax.Array]:
    """Cuts a stream of ``rounds`` messages of ``bits`` bits each (the capacity; a shorter stream's later
    parts read as zeros) into ``Message(payload[rounds, words], num_bits[rounds])``; also whether the
    payload is well formed (no bit past ``num_bits``, nothing missing)."""
    part_words = sent_words(bits)
    words = jnp.asarray(message.payload, jnp.uint32)
    sent = words.shape[0]
    words, ok = mask_to_length(_fit(words, sent_words(rounds * bits)), message.num_bits, num_sent_words=sent)
    if rounds == 1:
        return Message(words[None], jnp.full((1,), bits, BITS_DTYPE)), ok
    padded = jnp.pad(words, (0, part_words + 1))
    offsets = jnp.arange(rounds, dtype=jnp.int32) * bits
    payload = jax.vmap(lambda off: unpack_fixed(padded, part_words, 32, bit_offset=off))(offsets)
    payload = jax.vmap(lambda w: mask_to_length(w, bits)[0])(payload)
    return Message(payload, jnp.full((rounds,), bits, BITS_DTYPE)), ok


def _decode_parts(coder: Coder, shared_key, message: Message, dim: int, rounds: int, expected_bits):
    """The decoded parts ``[rounds, dim]`` of a stream of at most ``rounds`` messages and its error bitmask
    (``expected_bits``: the stream's length, static or traced)."""
    bits = message_bits(coder, dim)
    p = PointMass(jnp.zeros(dim, jnp.float32))
    state = coder.init(dim)
    parts, ok_length = _split(message, rounds, bits)
    decoded, checks = jax.vmap(lambda m: coder.decode(shared_key, p, state, m))(parts)
    ok_parse = as_bits(message.num_bits) == expected_bits
    errors = (
        jnp.bitwise_or.reduce(jnp.asarray(checks.errors, jnp.int32))
        | jnp.where(ok_length, 0, ERR_LENGTH)
        | jnp.where(ok_parse, 0, ERR_PARSE)
    )
    return decoded, errors.astype(jnp.int32)


def _reset_round(method: ErrorFeedbackMethod, rounds) -> jax.Array:
    """Whether the round after ``rounds`` completed rounds is a reset round (CSER's error reset, LIEC's
    averaging): every ``method.reset_period``-th round, public knowledge."""
    return (rounds + 1) % method.reset_period == 0


def _sum_parts(parts: jax.Array) -> jax.Array:
    """:math:`c_R = (\\dots(0 + c^{(1)}) + \\dots) + c^{(R)}` in this order (one ``lax.scan``), so every party
    that sums the same decoded parts gets the same bits."""
    total, _ = jax.lax.scan(lambda c, x: (c + x, None), jnp.zeros(parts.shape[1:], parts.dtype), parts)
    return total


def decompress(coder: Coder, shared_key, message: Message, dim: int, rounds: int):
    """The receiver's :math:`C_R(v)` from a stream of ``rounds`` messages: ``(c, errors)``; ``errors`` is
    the stream's bitmask (``ERR_PARSE`` when it is not exactly ``rounds`` messages long)."""
    parts, errors = _decode_parts(coder, shared_key, message, dim, rounds, rounds * message_bits(coder, dim))
    return _sum_parts(parts), errors


def compress(coder: Coder, keys: ClientKeys, v: jax.Array, rounds: int):
    """The sender's :math:`C_R(v)`: ``(message, c, valid)``. ``message`` holds the ``rounds`` messages back
    to back (``rounds * message_bits(coder, d)`` bits); ``c`` is what every receiver decodes from it
    (:func:`decompress`), bit for bit, so the sender's error feedback ``v - c`` is measured against exactly
    what was received; ``valid`` is False for a non-finite input or a malformed part."""
    parts, c, valid = _encode_parts(coder, keys, v, rounds)
    return _join(parts, None, rounds, message_bits(coder, v.shape[0])), c, valid


# ---------------------------------------------------------------------------------------------------
# kernels


def _flat(params: Params) -> jax.Array:
    return ravel_pytree(params)[0]


def _server_keys(key) -> ClientKeys:
    return ClientKeys(key, key)


def _initial_downlink(coder: Coder, key, dim: int, rounds: int) -> tuple[Message, jax.Array]:
    """:math:`C_R(0)` and the server memory :math:`0 - C_R(0)` (the scaled sign: ``rounds * (32 + d)`` zero
    bits, scale 0 and signs +, and a zero memory)."""
    zeros = jnp.zeros(dim, jnp.float32)
    message, c, _ = jax.jit(compress, static_argnames=("coder", "rounds"))(
        coder, _server_keys(key), zeros, rounds
    )
    return message, zeros - c


def compressed_init(method: ErrorFeedbackMethod, key, params: Params, num_clients: int) -> RoundState:
    """The initial state: the model; zero error memories; with a compressed downlink, every client's copy of
    the initial model (not sent, docs/papers/bicompfl.md#s8-17), a zero server memory and the first broadcast,
    :math:`C_R(0)`.

    Raises:
      ValueError: with a compressed downlink, if ``clients_per_round != num_clients``.
    """
    if method.downlink_rounds and method.clients_per_round != num_clients:
        raise ValueError(
            f"{method.name} broadcasts compressed model *changes*: a client that misses one drifts, so it "
            f"needs full participation (clients_per_round == num_clients); got clients_per_round="
            f"{method.clients_per_round} with num_clients={num_clients}"
        )
    flat = _flat(params)
    dim = flat.shape[0]
    errors = jnp.zeros((num_clients, dim), jnp.float32)
    if method.downlink_rounds:
        message, residual = _initial_downlink(method.coder, key, dim, method.downlink_rounds)
        server = CompressedState(params, residual, message, jnp.int32(0))
        clients = CompressedClientState(jnp.broadcast_to(flat, (num_clients, dim)), errors)
    else:
        server = CompressedState(params, EmptyState(), EmptyState(), jnp.int32(0))
        clients = CompressedClientState(EmptyState(), errors)
    return initial_round_state(server, clients, num_clients)


def compressed_broadcast(method: ErrorFeedbackMethod, key, server: CompressedState, client_ids):
    """The downlink: the pending compressed step (DoubleSqueeze, Neolithic) or the model as float32."""
    del key, client_ids
    if method.downlink_rounds:
        return server, server.downlink
    return server, encode_float32(_flat(server.params))


def compressed_receive(
    method: ErrorFeedbackMethod, dkey, keys, server: CompressedState, cstate: CompressedClientState, message
) -> CompressedReceived:
    """A client's decoding of the downlink: its own copy plus the decoded step (compressed downlink), or
    the float32 model (``server`` stands for what the client already knows: the shapes, the round number)."""
    del keys
    flat, unravel = ravel_pytree(server.params)
    dim = flat.shape[0]
    reset = _reset_round(method, server.rounds) if method.reset_period else jnp.asarray(False)
    if method.downlink_rounds:
        step, errors = decompress(method.coder, dkey, message, dim, method.downlink_rounds)
        return CompressedReceived(unravel(cstate.model + step), errors, reset)
    words = jnp.asarray(message.payload, jnp.uint32)
    ok = (as_bits(message.num_bits) == 32 * dim) & (words.shape[0] == dim)
    errors = jnp.where(ok, 0, ERR_PARSE).astype(jnp.int32)
    model = decode_float32(Message(_fit(words, dim), message.num_bits))
    return CompressedReceived(unravel(model), errors, reset)


def compressed_client_update(
    method: ErrorFeedbackMethod,
    local_train: Callable,
    keys: ClientKeys,
    received: CompressedReceived,
    cstate: CompressedClientState,
    data,
):
    """One client: local training from the model it holds, then the compressed uplink with error feedback.

    Mem-SGD, DoubleSqueeze, Neolithic: :math:`v = \\Delta + e`, message :math:`C_R(v)`,
    :math:`e \\leftarrow v - C_R(v)` with :math:`C_R(v)` decoded from the message itself. CSER: training
    starts from :math:`x = w + e`; the message is :math:`C(\\eta_S \\Delta)` and the rest stays in
    :math:`e`; in a reset round :math:`C(e)` follows in the same stream and leaves :math:`e`.
    """
    train_key, sample_key = client_streams(keys.private)
    ckeys = ClientKeys(keys.shared, sample_key)
    held, unravel = ravel_pytree(received.params)
    dim = held.shape[0]
    start = held + cstate.error if method.reset_period else held
    params, info = local_train(train_key, unravel(start), data)
    delta = _flat(params) - start
    if method.reset_period:
        vector = method.server_lr * delta
        parts, c, valid = _encode_parts(method.coder, ckeys, vector, 1)
        error = cstate.error + (vector - c)
        reset_parts, reset_c, reset_valid = _encode_parts(method.coder, ckeys, error, 1)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), parts, reset_parts)
        keep = jnp.stack([jnp.asarray(True), received.reset])
        message = _join(both, keep, 2, message_bits(method.coder, dim))
        error = jnp.where(received.reset, error - reset_c, error)
        valid = valid & (reset_valid | ~received.reset)
    else:
        vector = delta + cstate.error
        message, c, valid = compress(method.coder, ckeys, vector, method.uplink_rounds)
        error = vector - c
    model = held if method.downlink_rounds else EmptyState()
    finite = info.finite & jnp.all(jnp.isfinite(vector)) & jnp.all(jnp.isfinite(error))
    extra = CompressedClientExtra(info.num_steps, jnp.linalg.norm(error), received.errors)
    cinfo = ClientInfo(loss=info.loss, finite=finite, extra=extra, valid=valid & (received.errors == 0))
    return CompressedClientState(model, error), message, cinfo


def compressed_server_update(
    method: ErrorFeedbackMethod, rkey, server: CompressedState, client_ids, shared_keys, messages, weights
):
    """The server: decode every uplink, take the unweighted mean over the included participants
    (:func:`sidejax.coding.included`; docs/papers/bicompfl.md#s8-16), step. With none included the mean is
    zero: the model moves only by the server's own compressed memory (DoubleSqueeze, Neolithic), which the
    clients apply too, so the parties' copies stay bit-identical.

    Mem-SGD: :math:`w \\leftarrow w + \\eta_S \\bar c`. DoubleSqueeze, Neolithic: :math:`u = \\eta_S \\bar c +
    e_s`, the next broadcast is :math:`C_R(u)`, :math:`e_s \\leftarrow u - C_R(u)`, :math:`w \\leftarrow w +
    C_R(u)` (decoded from that message, as the clients will). CSER: :math:`w \\leftarrow w + \\bar c`, plus
    the mean decoded residual in a reset round.
    """
    del client_ids, weights  # the unweighted 1/|S_t| mean [P]
    flat, unravel = ravel_pytree(server.params)
    dim = flat.shape[0]
    coder = method.coder

    def mean_of(values, include):
        # over the included participants; nothing received (none included) is a zero mean, so every party
        # (the clients apply the server's compressed step too) stays bit-identical
        return jnp.where(jnp.any(include), masked_mean(values, include), jnp.zeros((), values.dtype))

    if method.reset_period:
        reset = _reset_round(method, server.rounds)
        expected = message_bits(coder, dim) * (1 + reset.astype(jnp.int32))
        parts, errors = jax.vmap(lambda k, m: _decode_parts(coder, k, m, dim, 2, expected))(
            shared_keys, messages
        )
        include = included(messages, errors == 0)
        new = flat + mean_of(parts[:, 0], include)
        new = jnp.where(reset, new + mean_of(parts[:, 1], include), new)
    else:
        rounds = method.uplink_rounds
        decoded, errors = jax.vmap(lambda k, m: decompress(coder, k, m, dim, rounds))(shared_keys, messages)
        mean = mean_of(decoded, included(messages, errors == 0))
    residual, downlink, downlink_valid = server.residual, server.downlink, jnp.asarray(True)
    if method.downlink_rounds:
        u = method.server_lr * mean + server.residual
        downlink, step, downlink_valid = compress(
            coder, _server_keys(stream_key(rkey, SERVER)), u, method.downlink_rounds
        )
        residual = u - step
        new = flat + step
    elif not method.reset_period:
        new = flat + method.server_lr * mean
    residual_norm = jnp.linalg.norm(residual) if method.downlink_rounds else jnp.float32(0.0)
    info = CompressedServerInfo(jnp.linalg.norm(new - flat), residual_norm, downlink_valid)
    state = CompressedState(unravel(new), residual, downlink, server.rounds + 1)
    return state, info, errors


def compressed_metrics(info: RoundInfo) -> dict:
    """The metrics hook: the participants' mean error-memory norm :math:`\\|e_i\\|_2` and the server's
    :math:`\\|e_s\\|_2` (0 with a float32 downlink)."""
    return {
        "client_error_norm": jnp.mean(info.clients.extra.error_norm, axis=-1),
        "server_residual_norm": info.server.residual_norm,
    }


def compressed_algorithm(method: ErrorFeedbackMethod, loss_fn: Callable, local: LocalTraining) -> Algorithm:
    """The :class:`sidejax.fl.Algorithm` of an :class:`ErrorFeedbackMethod` (the builders below make the
    method)."""
    return Algorithm(
        init=functools.partial(compressed_init, method),
        broadcast=functools.partial(compressed_broadcast, method),
        receive=functools.partial(compressed_receive, method),
        client_update=functools.partial(compressed_client_update, method, local.trainer(loss_fn)),
        server_update=functools.partial(compressed_server_update, method),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=method.clients_per_round,
        metrics=compressed_metrics,
        track_server=track_rounds,
    )


# ---------------------------------------------------------------------------------------------------
# builders


_SCALED_SIGN = scaled_sign_coder()  # one instance: the compiled programs that take it as static are reused


def _method(name: str, coder, server_lr, clients_per_round, **fields) -> ErrorFeedbackMethod:
    if isinstance(server_lr, bool) or not isinstance(server_lr, numbers.Real) or not server_lr > 0:
        raise ValueError(f"server_lr must be a number > 0, got {server_lr!r}")
    clients_per_round = check_count(clients_per_round, "clients_per_round", 1)
    coder = check_compressor(_SCALED_SIGN if coder is None else coder)
    return ErrorFeedbackMethod(name, coder, float(server_lr), clients_per_round, **fields)


def memsgd(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.1,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds Mem-SGD (Stich et al. 2018): client error feedback, compressed uplink (~1 bit per parameter
    with the scaled sign), float32 model downlink (32). Any participation.

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      local: the clients' training ([P]: Adam 3e-4, 3 epochs, batch 128).
      clients_per_round: participants per round.
      server_lr: :math:`\\eta_S` ([P]: 0.1).
      coder: the compressor (default :func:`sidejax.coding.scaled_sign_coder`).
    """
    method = _method("memsgd", coder, server_lr, clients_per_round)
    return compressed_algorithm(method, loss_fn, local)


def doublesqueeze(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.1,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds DoubleSqueeze (Tang et al. 2019): error-compensated compression on the clients and on the
    server, ~1 bit per parameter each way. Needs full participation (checked by ``init``).

    Args: as :func:`memsgd`.
    """
    method = _method("doublesqueeze", coder, server_lr, clients_per_round, downlink_rounds=1)
    return compressed_algorithm(method, loss_fn, local)


def neolithic(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.1,
    compress_rounds: int = 2,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds Neolithic (Huang et al. 2022) as docs/papers/bicompfl.md#s4-3 sketches it: DoubleSqueeze with
    :math:`C_R`, ``R = compress_rounds`` rounds of compressing the residual, both ways (~``R`` bits per
    parameter each way). Needs full participation (checked by ``init``).

    Args: as :func:`memsgd`, and ``compress_rounds`` (:math:`R \\ge 1`; [P]: 2).
    """
    rounds = check_count(compress_rounds, "compress_rounds", 1)
    method = _method(
        "neolithic", coder, server_lr, clients_per_round, uplink_rounds=rounds, downlink_rounds=rounds
    )
    return compressed_algorithm(method, loss_fn, local)


def cser(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.1,
    period: int = 50,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds CSER (Xie et al. 2020, CSER-PSync): the local residual stays in each client's model, with a
    compressed error reset every ``period`` rounds; compressed uplink (~1 + 1/period bits per parameter),
    float32 model downlink (32). Any participation.

    Args: as :func:`memsgd`, and ``period`` (rounds between error resets, >= 1; [P]: 50).
    """
    period = check_count(period, "period", 1)
    method = _method("cser", coder, server_lr, clients_per_round, reset_period=period)
    return compressed_algorithm(method, loss_fn, local)
