"""M3 (Gruntkowska, Tyurin and Richtárik 2024): MARINA-P's downlink of correlated permutation compressors,
with a compressed uplink and a momentum step; the BICompFL paper's baseline with TopK(d/n) on the uplink and
server learning rate 0.02 (docs/papers/bicompfl.md#s4-3, docs/papers/bicompfl.md#m3).

Notation: :math:`n` clients (every one in every round), :math:`d` parameters, :math:`x` the server's model,
:math:`w_i` client :math:`i`'s own model, :math:`g_i` its gradient estimator and :math:`g = \\frac1n \\sum_i
g_i` the server's copy of their mean, :math:`z_i` its momentum, :math:`\\beta \\in (0, 1]` the momentum
weight, :math:`\\eta_S` the server learning rate, :math:`p` the sync probability.

**Downlink (MARINA-P).** The broadcast at the start of round :math:`t` carries the server's last step
:math:`s = x^{t} - x^{t-1}`. With probability :math:`p` (a coin every party draws from the round's public
downlink key; never in round 0, which has no step yet) it is a **sync**: every client receives :math:`x^t` in
float32 and sets :math:`w_i = x^t`. Otherwise client :math:`i` receives its part of the **permutation
compressor** (PermK, Szlendak et al. 2021): a uniformly random permutation :math:`\\pi` of the coordinates,
public, cuts them into the :math:`n` disjoint parts :math:`B_i = \\{\\pi_k : k \\equiv i \\pmod n\\}`, and

.. math::

    Q_i(s) = n \\sum_{j \\in B_i} s_j e_j, \\qquad w_i \\leftarrow w_i + Q_i(s),

sent as the :math:`|B_i| = \\lceil (d - i)/n \\rceil` values :math:`n s_j` in float32 (the positions follow
from :math:`\\pi`). The parts are disjoint and cover every coordinate, so :math:`\\sum_i Q_i(s) = n s` exactly
and each :math:`Q_i` is unbiased, :math:`\\mathbb E_\\pi Q_i(s) = s`: the clients' models are unbiased but
different estimates of :math:`x`, and a sync resets them.

**Uplink (EF21 with momentum).** Client :math:`i` trains locally from :math:`w_i` to
:math:`w_i^{\\mathrm{end}}` and, with :math:`\\Delta_i = w_i^{\\mathrm{end}} - w_i` in place of the paper's
(negative) gradient,

.. math::

    z_i \\leftarrow (1 - \\beta) z_i + \\beta \\Delta_i, \\qquad c_i = \\mathrm{TopK}(z_i - g_i),
    \\qquad g_i \\leftarrow g_i + c_i,

sends :math:`c_i` (:func:`sidejax.coding.topk_coder`, :math:`K = \\lfloor d/n \\rfloor`: K float32 values
and K positions of ``ceil(log2 d)`` bits). :math:`g_i` tracks :math:`z_i` with error feedback: what TopK
drops stays in :math:`z_i - g_i` and is sent later, none of it is lost. The server adds the mean of the
decoded :math:`c_i` to :math:`g` (so :math:`g = \\frac1n \\sum_i g_i`) and steps
:math:`x \\leftarrow x + \\eta_S\\, g`.

Chosen where the spec is silent ([A], docs/papers/bicompfl.md#m3): the momentum weight :math:`\\beta` (0.1 in
the experiments, as EF21-M's; 1 is plain EF21), :math:`p = 1/n` (the sync's expected cost, :math:`32 d p`
bits, equals a compressed round's :math:`32 d / n`: MARINA's usual choice of :math:`p` as the compressor's
density), :math:`z_i = g_i = g = 0` at the start. Bits per parameter, read from the messages: uplink
:math:`K(32 + \\lceil \\log_2 d \\rceil)/d` (4.8 at LeNet5's d = 61,706 with n = 10), downlink :math:`32/n` or
32 in a sync round (6.1 on average at p = 1/n). Needs full participation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.compressed import _fit, _flat, check_compressor
from sidejax.bits import as_bits
from sidejax.coding.base import ERR_PARSE, Coder, Message, decode_float32, encode_float32, included
from sidejax.coding.bitstream import mask_to_length
from sidejax.coding.compress import topk_coder
from sidejax.distributions import PointMass
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, RoundInfo, initial_round_state
from sidejax.fl.local import LocalTraining
from sidejax.fl.roles import track_rounds
from sidejax.keys import DOWNLINK, ClientKeys, client_streams, draw_key, stream_key
from sidejax.types import Params
from sidejax.utils import check_count, check_number, check_positive, masked_mean

__all__ = [
    "M3Method",
    "M3State",
    "M3ClientState",
    "M3Received",
    "M3ClientExtra",
    "M3ServerInfo",
    "permutation_parts",
    "permutation_compress",
    "downlink_sync",
    "m3_init",
    "m3_broadcast",
    "m3_receive",
    "m3_client_update",
    "m3_server_update",
    "m3_metrics",
    "m3",
]


class M3Method(NamedTuple):
    """The static description of M3: ``coder`` (the uplink compressor, deterministic and of fixed length),
    ``server_lr`` (:math:`\\eta_S`), ``num_clients`` (:math:`n`: every client in every round), ``momentum``
    (:math:`\\beta`), ``sync_probability`` (:math:`p`)."""

    coder: Coder
    server_lr: float
    num_clients: int
    momentum: float
    sync_probability: float


class M3State(NamedTuple):
    """Server state: ``params`` (:math:`x`, evaluated), ``estimate`` (:math:`g`), ``step`` (:math:`x^t -
    x^{t-1}`, what the next broadcast carries), ``rounds`` (completed)."""

    params: Params
    estimate: jax.Array
    step: jax.Array
    rounds: jax.Array


class M3ClientState(NamedTuple):
    """Client state (stacked over all clients): ``model`` (:math:`w_i`), ``momentum`` (:math:`z_i`),
    ``estimate`` (:math:`g_i`), ``index`` (the client's id: which part of the permutation is its own)."""

    model: jax.Array
    momentum: jax.Array
    estimate: jax.Array
    index: jax.Array


class M3Received(NamedTuple):
    """What a client decoded: ``params`` (its updated :math:`w_i`) and the downlink's error bitmask."""

    params: Params
    errors: jax.Array


class M3ClientExtra(NamedTuple):
    """Per-client diagnostics: local steps, :math:`\\|z_i - g_i\\|_2` after the round (what TopK has not yet
    sent), the downlink's error bitmask."""

    num_steps: jax.Array
    error_norm: jax.Array
    downlink_errors: jax.Array


class M3ServerInfo(NamedTuple):
    """Server diagnostics: :math:`\\|x^{t+1} - x^t\\|_2`, :math:`\\|g\\|_2`, and whether this round's downlink
    was a sync."""

    update_norm: jax.Array
    estimate_norm: jax.Array
    sync: jax.Array


# ---------------------------------------------------------------------------------------------------
# the permutation compressor


def permutation_parts(key, dim: int, num_parts: int) -> tuple[jax.Array, jax.Array]:
    """PermK's parts: ``(positions, live)``, both ``[num_parts, ceil(dim / num_parts)]``. Part ``i`` holds the
    coordinates :math:`\\pi_k`, :math:`k \\equiv i \\pmod n`, of a uniformly random permutation :math:`\\pi`
    drawn from ``key``; ``live`` marks the real entries (part ``i`` has :math:`\\lceil (d - i)/n \\rceil`),
    the others hold ``dim`` (out of range)."""
    width = -(-dim // num_parts)
    perm = jax.random.permutation(key, dim).astype(jnp.int32)
    padded = jnp.concatenate([perm, jnp.full(width * num_parts - dim, dim, jnp.int32)])
    positions = padded.reshape(width, num_parts).T
    return positions, positions < dim


def permutation_compress(step: jax.Array, positions: jax.Array, live: jax.Array, num_parts: int) -> jax.Array:
    """The values of :math:`Q_i(s) = n\\, s|_{B_i}` for the parts ``positions`` / ``live`` of
    :func:`permutation_parts` (one part ``[w]`` or stacked ``[..., w]``): ``n s_j`` at live entries, 0
    elsewhere."""
    scaled = jnp.float32(num_parts) * step
    return jnp.where(live, scaled[jnp.minimum(positions, step.shape[0] - 1)], 0.0)


def _add_part(model: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """``model`` plus ``values`` at ``positions`` (out-of-range positions dropped): :math:`w_i + Q_i(s)`."""
    return model.at[positions].add(values, mode="drop")


def downlink_sync(method: M3Method, dkey, rounds) -> jax.Array:
    """Whether the downlink of the round after ``rounds`` completed rounds is a sync: a coin of probability
    :math:`p` from the public downlink key (``draw_key(dkey, 1)``), never in round 0."""
    return (rounds > 0) & jax.random.bernoulli(draw_key(dkey, 1), method.sync_probability)


def _parts(method: M3Method, dkey, dim: int):
    return permutation_parts(draw_key(dkey, 0), dim, method.num_clients)


# ---------------------------------------------------------------------------------------------------
# kernels


def m3_init(method: M3Method, key, params: Params, num_clients: int):
    """Every client's model is the initial model (not sent); :math:`z_i = g_i = g = 0`.

    Raises:
      ValueError: if ``num_clients`` is not the method's (full participation).
    """
    del key
    if num_clients != method.num_clients:
        raise ValueError(
            "m3 sends every client its own part of the model's change (a client that misses one cannot "
            "follow), so it needs full participation (clients_per_round == num_clients); got "
            f"clients_per_round={method.num_clients} with num_clients={num_clients}"
        )
    flat = _flat(params)
    dim = flat.shape[0]
    zeros = jnp.zeros((num_clients, dim), jnp.float32)
    clients = M3ClientState(
        jnp.broadcast_to(flat, (num_clients, dim)), zeros, zeros, jnp.arange(num_clients, dtype=jnp.int32)
    )
    server = M3State(params, jnp.zeros(dim, jnp.float32), jnp.zeros(dim, jnp.float32), jnp.int32(0))
    return initial_round_state(server, clients, num_clients)


def m3_broadcast(method: M3Method, dkey, server: M3State, client_ids):
    """One message per participant: :math:`x` as float32 in a sync, else its part :math:`Q_i(s)` as float32
    values (``num_bits[C]``, payload ``[C, d]`` words)."""
    flat = _flat(server.params)
    dim = flat.shape[0]
    positions, live = _parts(method, dkey, dim)
    sync = downlink_sync(method, dkey, server.rounds)
    values = permutation_compress(server.step, positions[client_ids], live[client_ids], method.num_clients)
    compressed = jax.vmap(lambda v: _fit(jax.lax.bitcast_convert_type(v, jnp.uint32), dim))(values)
    full = encode_float32(flat)
    payload = jnp.where(sync, jnp.broadcast_to(full.payload, compressed.shape), compressed)
    part_bits = 32 * jnp.sum(live[client_ids], axis=1)
    num_bits = jnp.where(sync, as_bits(full.num_bits), as_bits(part_bits))
    return server, Message(payload, num_bits)


def m3_receive(method: M3Method, dkey, keys, server: M3State, cstate: M3ClientState, message):
    """A client's :math:`w_i`: :math:`x` (a sync) or :math:`w_i + Q_i(s)` from its own part of the
    permutation (``server`` stands for what the client knows: the round number and the shapes)."""
    del keys
    flat, unravel = ravel_pytree(server.params)
    dim = flat.shape[0]
    positions, live = _parts(method, dkey, dim)
    sync = downlink_sync(method, dkey, server.rounds)
    mine, mine_live = positions[cstate.index], live[cstate.index]
    words = jnp.asarray(message.payload, jnp.uint32)
    words, ok = mask_to_length(_fit(words, dim), message.num_bits, num_sent_words=words.shape[0])
    expected = jnp.where(sync, 32 * dim, 32 * jnp.sum(mine_live))
    ok = ok & (as_bits(message.num_bits) == expected)
    values = jax.lax.bitcast_convert_type(words[: mine.shape[0]], jnp.float32)
    patched = _add_part(cstate.model, jnp.where(mine_live, values, 0.0), mine)
    model = jnp.where(sync, decode_float32(Message(words, message.num_bits)), patched)
    return M3Received(unravel(model), jnp.where(ok, 0, ERR_PARSE).astype(jnp.int32))


def m3_client_update(
    method: M3Method,
    local_train: Callable,
    keys: ClientKeys,
    received: M3Received,
    cstate: M3ClientState,
    data,
):
    """One client: local training from :math:`w_i`, the momentum step, and TopK of :math:`z_i - g_i` with
    :math:`g_i` advanced by exactly what the message decodes to."""
    train_key, sample_key = client_streams(keys.private)
    held, unravel = ravel_pytree(received.params)
    dim = held.shape[0]
    params, info = local_train(train_key, unravel(held), data)
    beta = jnp.float32(method.momentum)
    momentum = (1.0 - beta) * cstate.momentum + beta * (_flat(params) - held)
    p = PointMass(jnp.zeros(dim, jnp.float32))
    state = method.coder.init(dim)
    ckeys = ClientKeys(keys.shared, sample_key)
    message, enc = method.coder.encode(ckeys, PointMass(momentum - cstate.estimate), p, state)
    c, check = method.coder.decode(keys.shared, p, state, message)
    estimate = cstate.estimate + c
    finite = info.finite & jnp.all(jnp.isfinite(momentum)) & jnp.all(jnp.isfinite(estimate))
    extra = M3ClientExtra(info.num_steps, jnp.linalg.norm(momentum - estimate), received.errors)
    valid = jnp.asarray(enc.valid) & (check.errors == 0) & (received.errors == 0)
    cinfo = ClientInfo(loss=info.loss, finite=finite, extra=extra, valid=valid)
    return M3ClientState(held, momentum, estimate, cstate.index), message, cinfo


def m3_server_update(method: M3Method, rkey, server: M3State, client_ids, shared_keys, messages, weights):
    """The server: :math:`g \\leftarrow g + \\mathrm{mean}_i c_i` over the included participants (with none,
    :math:`g` keeps its value), :math:`x \\leftarrow x + \\eta_S g`, and the step for the next broadcast."""
    del client_ids, weights  # the unweighted 1/n mean [P]
    flat, unravel = ravel_pytree(server.params)
    dim = flat.shape[0]
    p = PointMass(jnp.zeros(dim, jnp.float32))
    state = method.coder.init(dim)
    decoded, checks = jax.vmap(lambda k, m: method.coder.decode(k, p, state, m))(shared_keys, messages)
    errors = jnp.asarray(checks.errors, jnp.int32)
    include = included(messages, errors == 0)
    mean = jnp.where(jnp.any(include), masked_mean(decoded, include), jnp.zeros((), decoded.dtype))
    estimate = server.estimate + mean
    new = flat + jnp.float32(method.server_lr) * estimate
    sync = downlink_sync(method, stream_key(rkey, DOWNLINK), server.rounds)  # this round's downlink
    info = M3ServerInfo(jnp.linalg.norm(new - flat), jnp.linalg.norm(estimate), sync)
    state = M3State(unravel(new), estimate, new - flat, server.rounds + 1)
    return state, info, errors


def m3_metrics(info: RoundInfo) -> dict:
    """The participants' mean :math:`\\|z_i - g_i\\|_2` (what TopK still owes) and :math:`\\|g\\|_2`."""
    return {
        "client_error_norm": jnp.mean(info.clients.extra.error_norm, axis=-1),
        "server_estimate_norm": info.server.estimate_norm,
    }


def m3_algorithm(method: M3Method, loss_fn: Callable, local: LocalTraining) -> Algorithm:
    """The :class:`sidejax.fl.Algorithm` of an :class:`M3Method`."""
    return Algorithm(
        init=functools.partial(m3_init, method),
        broadcast=functools.partial(m3_broadcast, method),
        receive=functools.partial(m3_receive, method),
        client_update=functools.partial(m3_client_update, method, local.trainer(loss_fn)),
        server_update=functools.partial(m3_server_update, method),
        evaluation=Evaluation(lambda state: state.server.params),
        clients_per_round=method.num_clients,
        metrics=m3_metrics,
        track_server=track_rounds,
    )


def _probability(value, name: str) -> float:
    return check_number(value, name, "a number in (0, 1]", lambda x: 0 < x <= 1)


def m3(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 0.02,
    momentum: float = 0.1,
    sync_probability: float | None = None,
    coder: Coder | None = None,
) -> Algorithm:
    """Builds M3 (Gruntkowska et al. 2024): permutation-compressed downlink with random syncs (MARINA-P),
    TopK uplink with EF21 error feedback and momentum. Needs full participation (checked by ``init``).

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      local: the clients' training ([P]: Adam 3e-4, 3 epochs, batch 128).
      clients_per_round: participants per round: every client, :math:`n`.
      server_lr: :math:`\\eta_S` ([P]: 0.02).
      momentum: :math:`\\beta \\in (0, 1]` (1: no momentum, plain EF21).
      sync_probability: :math:`p \\in (0, 1]` (default :math:`1/n`).
      coder: the uplink compressor (default :func:`sidejax.coding.topk_coder` ``(n)``, TopK(floor(d/n)) [P]);
        deterministic, of fixed length (:func:`sidejax.algorithms.compressed.check_compressor`).
    """
    server_lr = check_positive(server_lr, "server_lr")
    n = check_count(clients_per_round, "clients_per_round", 1)
    momentum = _probability(momentum, "momentum")
    sync_probability = (
        1.0 / n if sync_probability is None else _probability(sync_probability, "sync_probability")
    )
    coder = check_compressor(topk_coder(n) if coder is None else coder)
    method = M3Method(coder, server_lr, n, momentum, sync_probability)
    return m3_algorithm(method, loss_fn, local)
