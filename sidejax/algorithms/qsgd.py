"""QSGD (Alistarh et al., 2017) and QSGD-KLMS (KLMS paper Alg. 3 and 10;
docs/papers/klms.md#s4-3).

Each client trains locally from the global model :math:`w^{(t-1)}` and forms the model change
:math:`v = w^{(t,c)} - w^{(t-1)}`. Per tensor :math:`l` (the reference code's granularity), with
:math:`n_l = \\|v_l\\|_2` and ``s`` levels, the QSGD quantiser (eq. 1) is unbiased:

.. math::

    \\hat v_i = n_l \\, \\mathrm{sign}(v_i) \\, \\kappa_i / s, \\qquad
    \\kappa_i = \\lfloor r_i \\rfloor + \\mathrm{Bern}(r_i - \\lfloor r_i \\rfloor),
    \\quad r_i = s |v_i| / n_l.

- **QSGD** (``coder=elias_coder(s)``) sends the levels with QSGD's Elias coding: a real stream
  (:func:`sidejax.coding.lossless.elias_levels_encode`: gap, sign and level of each nonzero, the gaps over
  the whole flat vector so that the stream decodes without per-tensor counts), after the per-tensor norms
  as float32 side information (:func:`sidejax.coding.with_side_info`). The reported length is the
  stream's. :func:`qsgd_elias_bound_bits` gives the reference code's Elias *bound* (with its
  operator-precedence bug under ``paper_compat=True``), which reproduces the paper's QSGD bitrates
  (docs/papers/klms.md#s4-3); it is an accounting formula, reported beside the real length, never as it.
- **QSGD-KLMS** (``coder=klms_coder(config)``, s = 1, eq. 5) sends a KLMS sample of the symbol law
  :math:`q_i = (P(-1), P(0), P(+1)) = (\\max(-v_i/n_l, 0),\\ 1 - |v_i|/n_l,\\ \\max(v_i/n_l, 0))`
  against the side information :math:`p_i^{(t)}`: the per-coordinate empirical frequencies of the symbols
  the server decoded in the previous round [P], mixed with weight :math:`\\lambda` (``prior_smoothing``)
  with the tensor's pooled frequencies :math:`f_l` (docs/papers/klms.md#s4-4 [R]: "a mixture with the
  tensor-level frequencies"; a zero count would make the KL infinite):
  :math:`p_i(\\sigma) = (1 - \\lambda)\\,\\#\\{c: \\sigma_i^{(c)} = \\sigma\\}/C
  + \\lambda f_{l(i)}(\\sigma)`,
  :math:`f_l(\\sigma) = (n_l(\\sigma) + \\tfrac12)/(C d_l + \\tfrac32)`. Round 1 has no history and uses
  :math:`f_l(\\pm1) = 1/(2\\sqrt{d_l})`, the nonzero rate of a typical vector (:math:`E|v_i|/\\|v\\| \\approx
  1/\\sqrt{d_l}`). The first suggestion of docs/papers/klms.md#s8-9, additive smoothing
  ``(count + 0.5)/(C + 1.5)``, costs :math:`\\log_2(11.5/10.5) \\approx 0.13` bits on every all-zero
  coordinate with C = 10, as much as QSGD's Elias code. The default :math:`\\lambda = 1` uses the
  tensor-level frequencies only: with few clients the per-coordinate counts make ``p`` much sparser than
  ``q`` at most coordinates, and the finite-K coder then mostly returns the all-zero candidate (measured
  on digits, 10 clients, 10 rounds, server lr 1: test accuracy 29% with :math:`\\lambda = 0.1`, 36% with
  0.5, 45% with 1).
  The per-tensor norms are sent as float32 (32 bits each, counted; the paper does not say,
  docs/papers/klms.md#s8-8).

Server (sign corrected, docs/papers/klms.md#s8-4: ``v`` is local minus global, so the step is ``+``):
:math:`w^{(t)} = w^{(t-1)} + \\eta_S \\frac1C \\sum_c \\hat v^{(c)}`.
Downlink: :math:`w` as float32; when the coder decodes with ``p`` (QSGD-KLMS) also the symbol counts behind
the prior (2 fields of :math:`\\lceil\\log_2(C+1)\\rceil` bits per coordinate, then 1 bit: whether they are
a round's counts or round 1's "no history"), from which every client rebuilds ``p``, and the coder's protocol
stream.

The quantiser's law is one object for both coders, :class:`sidejax.distributions.StochasticLevels`: the Elias
coder sends its sample, and at s = 1 the KLMS coder sees it as the :class:`~sidejax.distributions.Ternary`
law of eq. 5 (:meth:`~sidejax.distributions.StochasticLevels.as_ternary`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from sidejax.algorithms.dense import DenseMethod, dense_algorithm
from sidejax.bits import as_bits
from sidejax.coding.base import Coder, Message, with_side_info
from sidejax.coding.bitstream import pack_fixed, unpack_fixed
from sidejax.coding.sample import elias_coder
from sidejax.distributions import StochasticLevels, Ternary
from sidejax.fl.base import Algorithm
from sidejax.fl.local import LocalTraining
from sidejax.layout import FlatLayout, tensor_norms
from sidejax.utils import masked_mean

__all__ = [
    "QSGDPrior",
    "qsgd_law",
    "qsgd_quantize",
    "qsgd_dequantize",
    "qsgd_elias_bound_bits",
    "symbol_prior",
    "initial_symbol_prior",
    "qsgd_method",
    "qsgd",
]


class QSGDPrior(NamedTuple):
    """The side information behind QSGD-KLMS's ``p``: the counts of -1 and +1 symbols (signs of the decoded
    levels) per coordinate in the last round, int32 ``[dim, 2]``, and whether there was a last round."""

    counts: jax.Array
    history: jax.Array


def qsgd_law(v: jax.Array, layout: FlatLayout, levels: int) -> tuple[StochasticLevels, jax.Array]:
    """QSGD's quantiser law (eq. 1) per tensor and the norms: ``(StochasticLevels(s v / n), norms)``."""
    norms = tensor_norms(v, layout)
    n = norms[jnp.asarray(layout.tensor_ids)]
    return StochasticLevels(levels * v / jnp.where(n > 0, n, 1.0)), norms


def qsgd_quantize(key, v: jax.Array, layout: FlatLayout, levels: int) -> tuple[jax.Array, jax.Array]:
    """QSGD's stochastic quantiser (eq. 1) per tensor: ``(signed_levels int32 [d], norms [num_tensors])``."""
    q, norms = qsgd_law(v, layout, levels)
    return q.sample(key).astype(jnp.int32), norms


def qsgd_dequantize(signed_levels: jax.Array, norms: jax.Array, layout: FlatLayout, levels: int) -> jax.Array:
    """:math:`\\hat v_i = n_{l(i)} \\cdot \\mathrm{sign}(v_i)\\kappa_i / s` (works on stacked levels too)."""
    return norms[..., jnp.asarray(layout.tensor_ids)] * signed_levels.astype(jnp.float32) / levels


def qsgd_elias_bound_bits(levels: int, tensor_sizes, *, paper_compat: bool = False) -> float:
    """QSGD's Elias-coding upper bound summed over tensors (as the KLMS reference code charges it).

    Per tensor of size :math:`d_l`:
    :math:`(3 + \\tfrac32 \\log_2 \\tfrac{2(s^2 + d_l)}{s(s + \\sqrt{d_l})}) \\, s(s + \\sqrt{d_l}) + 32`.
    ``paper_compat=True`` evaluates the reference code's expression, whose precedence bug computes
    :math:`\\log_2(\\tfrac{2(s^2+d_l)}{s} (s + \\sqrt{d_l}))`; it reproduces the paper's Table 8 QSGD
    bitrates (0.072 bpp at s = 1, 0.140 at s = 2 on CONV6; docs/papers/klms.md#s4-3). A formula, not a stream.
    """
    s = float(levels)
    total = 0.0
    for d in np.asarray(tensor_sizes, np.float64):
        m = s * (s + math.sqrt(d))
        ratio = 2 * (s * s + d) / s * (s + math.sqrt(d)) if paper_compat else 2 * (s * s + d) / m
        total += (3 + 1.5 * math.log2(ratio)) * m + 32
    return total


def symbol_counts(levels: jax.Array) -> jax.Array:
    """int32 ``[dim, 2]``: how many of the stacked ``levels[C, dim]`` are negative / positive, per
    coordinate."""
    return jnp.stack([jnp.sum(levels < 0, axis=0), jnp.sum(levels > 0, axis=0)], axis=-1).astype(jnp.int32)


def symbol_prior(counts: jax.Array, num: int, layout: FlatLayout, smoothing: float) -> jax.Array:
    """QSGD-KLMS side information ``[d, 3]`` from the last round's symbol counts of ``num`` clients (see the
    module docstring): per-coordinate frequencies mixed with the tensor's pooled frequencies."""
    minus, plus = counts[:, 0], counts[:, 1]
    c = jnp.stack([minus, num - minus - plus, plus], axis=-1).astype(jnp.float32)
    pooled = jax.ops.segment_sum(c, layout.tensor_ids, layout.num_tensors, indices_are_sorted=True)
    sizes = jnp.asarray(layout.tensor_sizes, jnp.float32)[:, None]
    f = (pooled + 0.5) / (num * sizes + 1.5)
    return (1.0 - smoothing) * c / num + smoothing * f[jnp.asarray(layout.tensor_ids)]


def initial_symbol_prior(layout: FlatLayout) -> jax.Array:
    """Round 1 (no history): :math:`f_l(\\pm1) = 1/(2\\sqrt{d_l})` per tensor."""
    nz = 0.5 / np.sqrt(layout.tensor_sizes.astype(np.float64))
    return jnp.asarray(np.stack([nz, 1.0 - 2.0 * nz, nz], axis=-1)[layout.tensor_ids], jnp.float32)


def _count_width(num: int) -> int:
    return math.ceil(math.log2(num + 1))


def qsgd_method(
    direction: Callable,
    *,
    levels: int,
    clients_per_round: int,
    prior_smoothing: float,
    server_step: Callable,
) -> DenseMethod:
    """The :class:`sidejax.algorithms.dense.DenseMethod` of a QSGD-quantised direction (QSGD; QLSD reuses
    it with a Langevin server step)."""
    width = _count_width(clients_per_round)

    def prior(state: QSGDPrior, layout: FlatLayout) -> Ternary:
        probs = symbol_prior(state.counts, clients_per_round, layout, prior_smoothing)
        return tuple.__new__(Ternary, (jnp.where(state.history, probs, initial_symbol_prior(layout)),))

    def prior_downlink(state: QSGDPrior) -> Message:
        # the counts, then one bit: whether they are a round's (``history``), which the receiver cannot tell
        # from the counts themselves (round 0's zeros, or a round that kept the previous prior)
        n = state.counts.size
        words = jnp.zeros(-(-(n * width + 1) // 32), jnp.uint32)
        words = pack_fixed(state.counts.reshape(-1).astype(jnp.uint32), width, out=words)
        words = pack_fixed(state.history.astype(jnp.uint32)[None], 1, bit_offset=n * width, out=words)
        return Message(words, as_bits(width * n + 1))

    def update_prior(state: QSGDPrior, samples, include) -> QSGDPrior:
        # the prior's counts are of clients_per_round clients (the zero count is the rest, and the downlink
        # sends no client count): a round with a participant excluded keeps the previous round's prior
        full = (include.shape[0] == clients_per_round) & jnp.all(include)
        new = QSGDPrior(symbol_counts(samples[0]), jnp.asarray(True))
        return jax.tree.map(lambda a, b: jnp.where(full, a, b), new, state)

    def prior_receive(state: QSGDPrior, message: Message) -> QSGDPrior:
        n = state.counts.size
        cap = -(-(n * width + 1) // 32)
        words = jnp.pad(jnp.asarray(message.payload, jnp.uint32), (0, max(0, cap - message.payload.shape[0])))
        counts = unpack_fixed(words, n, width).astype(jnp.int32).reshape(state.counts.shape)
        history = unpack_fixed(words, 1, 1, bit_offset=n * width)[0] > 0
        return QSGDPrior(counts, history)

    return DenseMethod(
        direction=direction,
        law=lambda v, layout: qsgd_law(v, layout, levels),
        prior=prior,
        reconstruct=lambda samples, layout: qsgd_dequantize(samples[0], samples[1], layout, levels),
        server_step=server_step,
        init_prior=lambda layout: QSGDPrior(jnp.zeros((layout.dim, 2), jnp.int32), jnp.asarray(False)),
        update_prior=update_prior,
        prior_downlink=prior_downlink,
        prior_receive=prior_receive,
        prior_bits=lambda state: 2 * width * state.counts.shape[0] + 1,
        wrap_coder=lambda coder, layout: with_side_info(coder, layout.num_tensors),
    )


def local_change(trainer: Callable) -> Callable:
    """``direction`` of the model-change methods: train locally from the global model, return
    :math:`v = w^{(t,c)} - w^{(t-1)}` (flat), the mean local loss and the finiteness flag."""

    def direction(train_key, params, data):
        local, linfo = trainer(train_key, params, data)
        return ravel_pytree(local)[0] - ravel_pytree(params)[0], linfo.loss, linfo.finite

    return direction


def mean_step(server_lr: float) -> Callable:
    """The unweighted server step over the included participants ``I`` [P]:
    :math:`w \\leftarrow w + \\eta_S \\frac{1}{|I|} \\sum_{c \\in I} \\hat v^{(c)}`."""

    def step(key, flat, vhat, include):
        del key  # unweighted 1/|I| mean [P]
        return flat + server_lr * masked_mean(vhat, include)

    return step


def qsgd(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    clients_per_round: int,
    server_lr: float = 1.0,
    levels: int = 1,
    coder: Coder | None = None,
    prior_smoothing: float = 1.0,
) -> Algorithm:
    """Builds QSGD (``coder=None`` or :func:`sidejax.coding.elias_coder`) or QSGD-KLMS
    (``coder=klms_coder(config)``, then ``levels`` must be 1).

    Args:
      loss_fn: the model's ``loss_fn(params, batch, key)``.
      local: the clients' training (:class:`sidejax.fl.LocalTraining`; [C]: Adam 3e-4).
      clients_per_round: participants per round.
      server_lr: :math:`\\eta_S` ([C]: 0.1 QSGD, 0.005 QSGD-KLMS with Adam clients).
      levels: QSGD's ``s``.
      coder: the coder of the levels (the norms are added as side information); default
        ``elias_coder(levels)``.
      prior_smoothing: weight :math:`\\lambda \\in (0, 1]` of the tensor-level frequencies in the prior.
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    coder = elias_coder(levels) if coder is None else coder
    if coder.uses_prior and levels != 1:
        raise ValueError(
            f"a coder that samples against the symbol prior (here {coder.name!r}) needs s = 1 symbols "
            f"(eq. 5); got levels={levels}"
        )
    if not 0 < prior_smoothing <= 1:
        raise ValueError(
            f"prior_smoothing must be in (0, 1] (a zero count would make the KL infinite), "
            f"got {prior_smoothing}"
        )
    if not server_lr > 0:
        raise ValueError(f"server_lr must be > 0, got {server_lr}")
    trainer = local.trainer(loss_fn)
    method = qsgd_method(
        local_change(trainer),
        levels=levels,
        clients_per_round=clients_per_round,
        prior_smoothing=prior_smoothing,
        server_step=mean_step(server_lr),
    )
    return dense_algorithm(method, coder, clients_per_round=clients_per_round)
