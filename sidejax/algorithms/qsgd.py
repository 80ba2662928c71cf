"""QSGD (Alistarh et al., 2017) and QSGD-KLMS (KLMS paper Alg. 3 and 10; spec ``klms.md`` §4.3-4.4).

Each client trains locally from the global model :math:`w^{(t-1)}` and forms the model change
:math:`v = w^{(t,c)} - w^{(t-1)}`. Per tensor :math:`l` (the reference code's granularity), with
:math:`n_l = \\|v_l\\|_2` and ``s`` levels, the QSGD quantiser (eq. 1) is unbiased:

.. math::

    \\hat v_i = n_l \\, \\mathrm{sign}(v_i) \\, \\kappa_i / s, \\qquad
    \\kappa_i = \\lfloor r_i \\rfloor + \\mathrm{Bern}(r_i - \\lfloor r_i \\rfloor),
    \\quad r_i = s |v_i| / n_l.

- **QSGD** sends the levels with QSGD's Elias coding. The reported length is the exact length of that
  stream (:func:`sidejax.algorithms.common.elias_gamma_bits`: per tensor a 32-bit norm, then gap, sign and
  level of each nonzero), computed from the quantised symbols. ``paper_compat=True`` charges instead the
  reference code's Elias *bound* with its operator-precedence bug (:func:`qsgd_elias_bound_bits`), which
  reproduces the paper's QSGD bitrates (spec §4.3).
- **QSGD-KLMS** (s = 1, eq. 5) sends a KLMS sample of the symbol law
  :math:`q_i = (P(-1), P(0), P(+1)) = (\\max(-v_i/n_l, 0),\\ 1 - |v_i|/n_l,\\ \\max(v_i/n_l, 0))`
  against the side information :math:`p_i^{(t)}`: the per-coordinate empirical frequencies of the symbols
  the server decoded in the previous round [P], mixed with weight :math:`\\lambda` (``prior_smoothing``)
  with the tensor's pooled frequencies :math:`f_l` (spec §4.4 [R]: "a mixture with the tensor-level
  frequencies"; a zero count would make the KL infinite):
  :math:`p_i(\\sigma) = (1 - \\lambda)\\,\\#\\{c: \\sigma_i^{(c)} = \\sigma\\}/C
  + \\lambda f_{l(i)}(\\sigma)`,
  :math:`f_l(\\sigma) = (n_l(\\sigma) + \\tfrac12)/(C d_l + \\tfrac32)`. Round 1 has no history and uses
  :math:`f_l(\\pm1) = 1/(2\\sqrt{d_l})`, the nonzero rate of a typical vector (:math:`E|v_i|/\\|v\\| \\approx
  1/\\sqrt{d_l}`). The spec's first suggestion, additive smoothing ``(count + 0.5)/(C + 1.5)``, costs
  :math:`\\log_2(11.5/10.5) \\approx 0.13` bits on every all-zero coordinate with C = 10, as much as
  QSGD's Elias code. The default :math:`\\lambda = 1` uses the tensor-level frequencies only: with few
  clients the per-coordinate counts make ``p`` much sparser than ``q`` at most coordinates, and the
  finite-K coder then mostly returns the all-zero candidate (measured on digits, 10 clients, 10 rounds,
  server lr 1: test accuracy 29% with :math:`\\lambda = 0.1`, 36% with 0.5, 45% with 1).
  The per-tensor norms are sent as float32 (32 bits each, counted; the paper does not say, spec §8 #8).

Server (sign corrected, spec §8 #4: ``v`` is local minus global, so the step is ``+``):
:math:`w^{(t)} = w^{(t-1)} + \\eta_S \\frac1C \\sum_c \\hat v^{(c)}`.
Downlink: :math:`w` as float32; for QSGD-KLMS also the symbol counts (2 fields of
:math:`\\lceil\\log_2(C+1)\\rceil` bits per coordinate) and the protocol bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.common import (
    FlatLayout,
    broadcast_params,
    client_streams,
    elias_gamma_bits,
    flat_layout,
    tensor_norms,
)
from sidejax.coding.base import Message, decode_float32, encode_float32
from sidejax.coding.bitstream import pack_fixed, unpack_fixed
from sidejax.distributions import Ternary
from sidejax.fl.base import Algorithm, ClientInfo, EmptyState, RoundState, initial_round_state
from sidejax.fl.local import build_local_trainer
from sidejax.fl.rounds import build_round_step
from sidejax.keys import ClientKeys
from sidejax.klms import (
    KLMSClientInfo,
    KLMSConfig,
    KLMSServerInfo,
    KLMSState,
    klms_decode_clients,
    klms_encode,
    klms_init,
    klms_server_update,
)
from sidejax.types import Params

__all__ = [
    "QSGDState",
    "CompressedExtra",
    "CompressedServerInfo",
    "qsgd_quantize",
    "qsgd_dequantize",
    "qsgd_symbol_probs",
    "symbol_prior",
    "qsgd_elias_bound_bits",
    "qsgd_message",
    "qsgd_decode",
    "qsgd",
]


class QSGDState(NamedTuple):
    """Server state: global ``params``; ``prior`` ``[d, 3]`` symbol law (QSGD-KLMS; ``EmptyState()``
    otherwise); ``klms`` protocol state."""

    params: Params
    prior: jax.Array | EmptyState
    klms: KLMSState | EmptyState


class CompressedExtra(NamedTuple):
    """Per-client diagnostics of the compressed dense methods.

    Attributes:
      kl_bits: the ideal KLMS rate :math:`\\sum_j D_{KL}(q_j \\| p_j)` in bits (KLMS variants; NaN otherwise).
      klms: the coder's diagnostics (KLMS variants; ``EmptyState()`` otherwise).
    """

    kl_bits: jax.Array
    klms: KLMSClientInfo | EmptyState


class CompressedServerInfo(NamedTuple):
    """``update_norm``: norm of the server's model change; ``klms``: protocol diagnostics (KLMS only)."""

    update_norm: jax.Array
    klms: KLMSServerInfo | EmptyState


def qsgd_quantize(key, v: jax.Array, layout: FlatLayout, levels: int) -> tuple[jax.Array, jax.Array]:
    """QSGD's stochastic quantiser (eq. 1) per tensor.

    Returns:
      ``(signed_levels, norms)``: int32 ``[d]`` values :math:`\\mathrm{sign}(v_i)\\kappa_i \\in [-s, s]`, and
      float32 ``[num_tensors]`` norms.
    """
    norms = tensor_norms(v, layout)
    n = norms[jnp.asarray(layout.tensor_ids)]
    r = levels * jnp.abs(v) / jnp.where(n > 0, n, 1.0)
    low = jnp.floor(r)
    up = jax.random.uniform(key, v.shape) < (r - low)
    kappa = jnp.where(n > 0, low + up, 0.0)
    return (jnp.sign(v) * kappa).astype(jnp.int32), norms


def qsgd_dequantize(signed_levels: jax.Array, norms: jax.Array, layout: FlatLayout, levels: int) -> jax.Array:
    """:math:`\\hat v_i = n_{l(i)} \\cdot \\mathrm{sign}(v_i)\\kappa_i / s`."""
    return norms[jnp.asarray(layout.tensor_ids)] * signed_levels.astype(jnp.float32) / levels


def qsgd_symbol_probs(v: jax.Array, layout: FlatLayout) -> tuple[Ternary, jax.Array]:
    """The s = 1 symbol law of eq. (5) as a :class:`sidejax.distributions.Ternary`, and the norms."""
    norms = tensor_norms(v, layout)
    n = norms[jnp.asarray(layout.tensor_ids)]
    a = jnp.clip(v / jnp.where(n > 0, n, 1.0), -1.0, 1.0)
    probs = jnp.stack([jnp.maximum(-a, 0.0), 1.0 - jnp.abs(a), jnp.maximum(a, 0.0)], axis=-1)
    return Ternary(probs), norms


def qsgd_elias_bound_bits(levels: int, tensor_sizes, *, paper_compat: bool = False) -> float:
    """QSGD's Elias-coding upper bound summed over tensors (as the KLMS reference code charges it).

    Per tensor of size :math:`d_l`:
    :math:`(3 + \\tfrac32 \\log_2 \\tfrac{2(s^2 + d_l)}{s(s + \\sqrt{d_l})}) \\, s(s + \\sqrt{d_l}) + 32`.
    ``paper_compat=True`` evaluates the reference code's expression, whose precedence bug computes
    :math:`\\log_2(\\tfrac{2(s^2+d_l)}{s} (s + \\sqrt{d_l}))`; it reproduces the paper's Table 8 QSGD
    bitrates (0.072 bpp at s = 1, 0.140 at s = 2 on CONV6; spec §4.3).
    """
    s = float(levels)
    total = 0.0
    for d in np.asarray(tensor_sizes, np.float64):
        m = s * (s + math.sqrt(d))
        ratio = 2 * (s * s + d) / s * (s + math.sqrt(d)) if paper_compat else 2 * (s * s + d) / m
        total += (3 + 1.5 * math.log2(ratio)) * m + 32
    return total


def symbol_prior(symbols: jax.Array, layout: FlatLayout, smoothing: float) -> jax.Array:
    """QSGD-KLMS side information ``[d, 3]`` from the decoded symbols ``[C, d]`` of the last round (see the
    module docstring): per-coordinate frequencies mixed with the tensor's pooled frequencies."""
    num = symbols.shape[0]
    counts = jnp.stack([jnp.sum(symbols == s, axis=0) for s in (-1.0, 0.0, 1.0)], axis=-1).astype(jnp.float32)
    pooled = jax.ops.segment_sum(counts, layout.tensor_ids, layout.num_tensors, indices_are_sorted=True)
    sizes = jnp.asarray(layout.tensor_sizes, jnp.float32)[:, None]
    f = (pooled + 0.5) / (num * sizes + 1.5)
    return (1.0 - smoothing) * counts / num + smoothing * f[jnp.asarray(layout.tensor_ids)]


def _symbol_width(levels: int) -> int:
    return max(1, math.ceil(math.log2(2 * levels + 1)))


def qsgd_message(signed_levels, norms, layout: FlatLayout, levels: int, *, paper_compat: bool) -> Message:
    """QSGD's message. Payload: the symbols (``signed + s`` in fixed-width fields) and the norms (float32
    words), from which the server decodes; length: the Elias stream's exact length (or the paper's bound)."""
    payload = (
        pack_fixed((signed_levels + levels).astype(jnp.uint32), _symbol_width(levels)),
        encode_float32(norms).payload,
    )
    if paper_compat:
        bits = jnp.float32(qsgd_elias_bound_bits(levels, layout.tensor_sizes, paper_compat=True))
    else:
        bits = elias_gamma_bits(signed_levels, layout)
    return Message(payload=payload, num_bits=bits)


def qsgd_decode(message: Message, layout: FlatLayout, levels: int) -> jax.Array:
    """Inverse of :func:`qsgd_message`: the dequantised vector."""
    sym_words, norm_words = message.payload
    signed = unpack_fixed(sym_words, layout.dim, _symbol_width(levels)).astype(jnp.int32) - levels
    norms = decode_float32(Message(norm_words, jnp.float32(0)))
    return qsgd_dequantize(signed, norms, layout, levels)


def qsgd(
    loss_fn: Callable,
    client_optimizer: optax.GradientTransformation,
    *,
    clients_per_round: int,
    batch_size: int,
    local_epochs: int = 1,
    server_lr: float = 1.0,
    levels: int = 1,
    klms: KLMSConfig | None = None,
    prior_smoothing: float = 1.0,
    paper_compat: bool = False,
    client_strategy: str | None = None,
    map_batch_size: int | None = None,
) -> Algorithm:
    """Builds QSGD, or QSGD-KLMS when ``klms`` is given (then ``levels`` must be 1).

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      client_optimizer: local optimizer ([C]: Adam 3e-4).
      clients_per_round, batch_size, local_epochs: federation and local training.
      server_lr: :math:`\\eta_S` ([C]: 0.1 QSGD, 0.005 QSGD-KLMS with Adam clients).
      levels: QSGD's ``s``.
      klms: KLMS settings (QSGD-KLMS); ``None`` for QSGD.
      prior_smoothing: weight :math:`\\lambda \\in (0, 1]` of the tensor-level frequencies in the prior.
      paper_compat: charge the reference code's buggy Elias bound (QSGD only).
      client_strategy, map_batch_size: see :func:`sidejax.fl.build_round_step`.
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    if klms is not None and levels != 1:
        raise ValueError(f"QSGD-KLMS uses s = 1 symbols (eq. 5); got levels={levels}")
    if not 0 < prior_smoothing <= 1:
        raise ValueError(
            f"prior_smoothing must be in (0, 1] (a zero count would make the KL infinite), "
            f"got {prior_smoothing}"
        )
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr}")
    trainer = build_local_trainer(loss_fn, client_optimizer, batch_size=batch_size, num_epochs=local_epochs)
    count_bits = math.ceil(math.log2(clients_per_round + 1))

    def init(key, params: Params, num_clients: int) -> RoundState:
        del key
        dim = flat_layout(params).dim
        if klms is None:
            return initial_round_state(
                QSGDState(params, EmptyState(), EmptyState()), EmptyState(), num_clients
            )
        layout = flat_layout(params)
        nz = 0.5 / np.sqrt(layout.tensor_sizes.astype(np.float64))
        f = np.stack([nz, 1.0 - 2.0 * nz, nz], axis=-1)[layout.tensor_ids]
        prior = jnp.asarray(f, jnp.float32)
        return initial_round_state(QSGDState(params, prior, klms_init(dim, klms)), EmptyState(), num_clients)

    def broadcast_fn(key, server: QSGDState, client_ids):
        del key
        if klms is None:
            return broadcast_params(server, client_ids)
        counts = 2 * count_bits * flat_layout(server.params).dim  # the symbol counts behind the prior
        return broadcast_params(server, client_ids, klms, extra_bits=counts)

    def client_update(keys: ClientKeys, server: QSGDState, state, data):
        layout = flat_layout(server.params)
        train_key, sample_key = client_streams(keys.private)
        local, linfo = trainer(train_key, server.params, data)
        v = ravel_pytree(local)[0] - ravel_pytree(server.params)[0]
        if klms is None:
            signed, norms = qsgd_quantize(sample_key, v, layout, levels)
            message = qsgd_message(signed, norms, layout, levels, paper_compat=paper_compat)
            extra = CompressedExtra(jnp.float32(jnp.nan), EmptyState())
        else:
            q, norms = qsgd_symbol_probs(v, layout)
            p = Ternary(server.prior)
            kmsg, kinfo = klms_encode(ClientKeys(keys.shared, sample_key), q, p, server.klms, klms)
            nmsg = encode_float32(norms)
            message = Message((kmsg.payload, nmsg.payload), kmsg.num_bits + nmsg.num_bits)
            extra = CompressedExtra(kinfo.kl_bits, kinfo)
        finite = linfo.finite & jnp.all(jnp.isfinite(v))
        return state, message, ClientInfo(loss=linfo.loss, finite=finite, extra=extra)

    def server_update(rkey, server: QSGDState, client_ids, messages, weights):
        del weights  # unweighted 1/C mean [P]
        layout = flat_layout(server.params)
        flat, unravel = ravel_pytree(server.params)
        if klms is None:
            vhat = jax.vmap(lambda m: qsgd_decode(m, layout, levels))(messages)
            prior, kstate, kinfo = server.prior, server.klms, EmptyState()
        else:
            kwords, nwords = messages.payload
            kmsgs = Message(kwords, messages.num_bits - 32.0 * layout.num_tensors)
            symbols, decoded = klms_decode_clients(
                rkey, client_ids, Ternary(server.prior), server.klms, kmsgs, klms
            )
            norms = jax.vmap(lambda w: decode_float32(Message(w, jnp.float32(0))))(nwords)
            vhat = norms[:, jnp.asarray(layout.tensor_ids)] * symbols
            prior = symbol_prior(symbols, layout, prior_smoothing)
            kstate, kinfo = klms_server_update(server.klms, decoded, klms)
        step = server_lr * jnp.mean(vhat, axis=0)
        new = QSGDState(unravel(flat + step), prior, kstate)
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
